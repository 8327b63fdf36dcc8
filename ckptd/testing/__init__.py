"""Fakes of ckptd's ports, for tests of code built on ckptd (in the style of trio.testing).

Each fake implements one Protocol of ``ckptd.core.ports`` in memory, records what it was
asked, and can be told to fail; together they let ``DumpRecipe``, ``RestoreRecipe`` and
``CheckpointService`` run without root, CRIU or real processes. They pass the same contract
suites (``tests/contract``) as the real adapters.

- ``FakeClock``: ``Clock``; ``sleep`` advances time at once.
- ``FakeCgroups``: ``Cgroups`` over a dict pid -> cgroup (processes inherit their parent's).
- ``FakeProcessTable`` / ``FakeProcess`` / ``FakeHandle``: ``ProcessTable`` over a dict of fake
  processes, and ``ProcessHandle`` s bound to one fake process each.
- ``RecordingHooks``: ``CriuHooks`` recording each notification's name, refusing one on demand.
- ``FakeCriu``: ``Criu`` acting on a ``FakeProcessTable``, writing fake images.
- ``MemoryStore``: ``CheckpointStore`` with records in memory, images in a real directory.
- ``MemoryBlobStore``: ``BlobStore`` in memory (for ``ContentStore``), with crash simulation and
  failure injection.
- ``MemoryJournal``: ``Journal`` in memory.
- ``FakeStdioProvider``: ``StdioProvider`` handing out /dev/null descriptors.
- ``FakeNodeInspector`` / ``FakeFile``: ``NodeInspector`` over facts and files in memory.
- ``FakeJobFiles``: ``JobFiles`` over real files a test declares written by fake pids.
- ``FakeAsideLog``: ``AsideLog`` (the record of the copies restores kept aside) in memory.
- ``FakeThreadHold``: ``ThreadHold`` recording which processes' threads are held (and
  which thread of each is left to run); ``FakeGpu`` given it checks them at restore.
- ``FakeTreeGuard``: ``TreeGuard`` feeding the guard's own ``TreeWatch`` in this process over a
  ``FakeProcessTable`` and a journal; ``daemon_gone`` is the daemon's death.
- ``MemoryPageExchange``: ``PageExchange`` (a migration's pages, in a target's hash space) over
  checkpoints added whole, in memory.
- ``LoopbackPeerConnector``: ``PeerConnector`` reaching ``Receiver`` s in this process.

Most fakes accept ``events``, a list shared between them, to which they append what
happened, so a test can check the order of effects across ports.
"""

from ckptd.testing._asides import FakeAsideLog
from ckptd.testing._blobs import MemoryBlobStore
from ckptd.testing._cgroups import FakeCgroups
from ckptd.testing._clock import FakeClock
from ckptd.testing._criu import DUMP_HOOKS, RESTORE_HOOKS, FakeCriu
from ckptd.testing._files import FakeJobFiles
from ckptd.testing._gpu import H100, FakeCudaProcess, FakeGpu
from ckptd.testing._guard import FakeTreeGuard
from ckptd.testing._hooks import RecordingHooks
from ckptd.testing._journal import MemoryJournal
from ckptd.testing._node import FakeFile, FakeNodeInspector
from ckptd.testing._pages import MemoryPageExchange
from ckptd.testing._peer import LoopbackPeerConnector, LoopbackPeerLink, LoopbackPeerSession
from ckptd.testing._policies import MemoryPolicyRepo
from ckptd.testing._processes import FakeHandle, FakeProcess, FakeProcessTable, KillMode
from ckptd.testing._stdio import FakeStdioProvider
from ckptd.testing._store import MemoryStore
from ckptd.testing._threads import FakeThreadHold

__all__ = [
    "DUMP_HOOKS",
    "H100",
    "RESTORE_HOOKS",
    "FakeAsideLog",
    "FakeCgroups",
    "FakeClock",
    "FakeCriu",
    "FakeCudaProcess",
    "FakeFile",
    "FakeGpu",
    "FakeHandle",
    "FakeJobFiles",
    "FakeNodeInspector",
    "FakeProcess",
    "FakeProcessTable",
    "FakeStdioProvider",
    "FakeThreadHold",
    "FakeTreeGuard",
    "KillMode",
    "LoopbackPeerConnector",
    "LoopbackPeerLink",
    "LoopbackPeerSession",
    "MemoryBlobStore",
    "MemoryJournal",
    "MemoryPageExchange",
    "MemoryPolicyRepo",
    "MemoryStore",
    "RecordingHooks",
]
