"""Implementations under contract, and harnesses that set up equivalent facts for each.

Each port's implementations are listed in one dict; a new backend is one line there, and then
runs every contract test of that port (the fixtures are in ``conftest.py``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal
from unittest import mock

import pytest

from ckptd.adapters.criu.images import is_pages_image
from ckptd.adapters.procfs import ProcFsTable
from ckptd.adapters.storage import FileJournal, LocalBlobStore
from ckptd.core.ports import BlobStore, CheckpointStore, Journal, ProcessTable
from ckptd.core.store.cas import ContentStore, StagingPolicy
from ckptd.core.store.keys import ManifestKeys
from ckptd.domain import PidState, StdioFact, StdioKind
from ckptd.testing import (
    FakeClock,
    FakeProcessTable,
    MemoryBlobStore,
    MemoryJournal,
    MemoryStore,
)

MANIFEST_KEYS = ManifestKeys.generate()
"""One node's manifest keys (a store reopened is read with the same keys)."""


# ---- CheckpointStore ----------------------------------------------------------------------

STORES: dict[str, Callable[[Path], CheckpointStore]] = {
    "content-local": lambda tmp: ContentStore(
        LocalBlobStore(tmp / "store"),
        StagingPolicy(None, tmp / "staging"),
        clock=FakeClock(),
        is_pages_file=is_pages_image,
        keys=MANIFEST_KEYS,
    ),
    "memory": lambda tmp: MemoryStore(tmp / "store"),
}



# ---- Journal ---------------------------------------------------------------------------------


@dataclass
class JournalHarness:
    journal: Journal
    reopen: Callable[[], Journal]
    """Another handle on the same journal (for a durable one: a new instance, as after a
    daemon restart)."""


def _file_journal(tmp: Path) -> JournalHarness:
    return JournalHarness(FileJournal(tmp / "journal"), lambda: FileJournal(tmp / "journal"))


def _memory_journal(tmp: Path) -> JournalHarness:
    journal = MemoryJournal()
    return JournalHarness(journal, lambda: journal)


JOURNALS: dict[str, Callable[[Path], JournalHarness]] = {
    "file": _file_journal,
    "memory": _memory_journal,
}



# ---- ProcessTable ----------------------------------------------------------------------------

StdoutKind = Literal["pipe", "devnull", "file"]
UringKeep = Literal["fd", "mapped"]
URING_JOB = Path(__file__).resolve().parents[1] / "uring_job.py"


class ProcessHarness:
    """Makes processes in known states for a ``ProcessTable`` under test.

    Every process made is a child of ``self_pid`` owned by ``uid``.
    """

    table: ProcessTable
    self_pid: int
    uid: int
    real: bool

    def spawn(self) -> int:
        """A running child (``comm`` "sleep")."""
        raise NotImplementedError

    def spawn_tree(self) -> tuple[int, tuple[int, ...]]:
        """A running child with two running children of its own: (root, children)."""
        raise NotImplementedError

    def zombie(self) -> int:
        """A child that was killed and not reaped."""
        raise NotImplementedError

    def stopped(self) -> int:
        """A child stopped with SIGSTOP."""
        raise NotImplementedError

    def free_pid(self) -> int:
        """A pid no process has."""
        raise NotImplementedError

    def spawn_mixed_uid(self, real_uid: int) -> int:
        """A running child with real uid ``real_uid`` and effective and saved uid 0."""
        raise NotImplementedError

    def spawn_with_stdout(self, kind: StdoutKind) -> int:
        """A child whose stdin/stderr are /dev/null and whose stdout is a pipe the test holds
        the read end of, /dev/null, or a regular file."""
        raise NotImplementedError

    def reuse_pid(self, pid: int) -> int:
        """End and reap the child at ``pid``, then start a new child at that same pid."""
        raise NotImplementedError

    def spawn_pidns_tree(self) -> tuple[int, tuple[int, ...]]:
        """The init of a pid namespace of its own (pid 1 in it) with two children there:
        (root, children), pids in this namespace."""
        raise NotImplementedError

    def spawn_io_uring(self, keep: UringKeep) -> int:
        """A running child that made an io_uring instance and holds it by an fd ("fd") or
        only by a mapping of its ring, the fd closed ("mapped")."""
        raise NotImplementedError

    def wait_state(self, pid: int, state: PidState, timeout: float = 5.0) -> PidState:
        """Poll ``table.status(pid)`` until it is ``state`` (signals are asynchronous)."""
        deadline = time.monotonic() + timeout
        current = self.table.status(pid).state
        while current is not state and time.monotonic() < deadline:
            time.sleep(0.005)
            current = self.table.status(pid).state
        return current

    def close(self) -> None:
        """Kill and reap what was made."""


class ProcFsHarness(ProcessHarness):
    def __init__(self, tmp: Path) -> None:
        self.table = ProcFsTable()
        self.self_pid = os.getpid()
        self.uid = os.getuid()
        self.real = True
        self._tmp = tmp
        self._children: list[subprocess.Popen[bytes]] = []
        self._files: list[IO[bytes]] = []

    def _popen(self, argv: list[str], stdout: int | IO[bytes] = subprocess.DEVNULL) -> int:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.DEVNULL
        )
        self._children.append(proc)
        return proc.pid

    def spawn(self) -> int:
        return self._popen(["sleep", "60"])

    def spawn_tree(self) -> tuple[int, tuple[int, ...]]:
        root = self._popen(["sh", "-c", "sleep 60 & sleep 60 & wait"])
        deadline = time.monotonic() + 5
        kids: tuple[int, ...] = ()
        while time.monotonic() < deadline:
            listed = Path(f"/proc/{root}/task/{root}/children").read_text().split()
            kids = tuple(sorted(int(p) for p in listed))
            comms = {Path(f"/proc/{k}/comm").read_text().strip() for k in kids}
            if len(kids) == 2 and comms == {"sleep"}:
                return root, kids
            time.sleep(0.01)
        raise AssertionError(f"sh {root} did not start its two children: {kids}")

    def zombie(self) -> int:
        pid = self.spawn()
        os.kill(pid, signal.SIGKILL)
        assert self.wait_state(pid, PidState.ZOMBIE) is PidState.ZOMBIE
        return pid

    def stopped(self) -> int:
        pid = self.spawn()
        os.kill(pid, signal.SIGSTOP)
        assert self.wait_state(pid, PidState.STOPPED) is PidState.STOPPED
        return pid

    def free_pid(self) -> int:
        proc = subprocess.Popen(["true"])
        proc.wait()
        return proc.pid

    def spawn_mixed_uid(self, real_uid: int) -> int:
        code = f"import os, time; os.setresuid({real_uid}, 0, 0); print(flush=True); time.sleep(60)"
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE
        )
        self._children.append(proc)
        assert proc.stdout is not None
        proc.stdout.readline()  # setresuid done
        return proc.pid

    def spawn_with_stdout(self, kind: StdoutKind) -> int:
        if kind == "pipe":
            return self._popen(["sleep", "60"], stdout=subprocess.PIPE)
        if kind == "devnull":
            return self._popen(["sleep", "60"])
        out = (self._tmp / "stdout.txt").open("wb")
        self._files.append(out)
        return self._popen(["sleep", "60"], stdout=out)

    def reuse_pid(self, pid: int) -> int:
        (old,) = [p for p in self._children if p.pid == pid]
        old.kill()
        old.wait()
        for _ in range(50):  # other processes on the node may take the pid first: retry
            Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
            proc = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
            self._children.append(proc)
            if proc.pid == pid:
                return pid
        raise AssertionError(f"could not start a process at pid {pid} again")

    def spawn_io_uring(self, keep: UringKeep) -> int:
        proc = subprocess.Popen(
            [sys.executable, str(URING_JOB), "--keep", keep, "--period", "1"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )
        self._children.append(proc)
        assert proc.stdout is not None
        said = proc.stdout.readline().decode().strip()
        if said != "io_uring_setup: fd":
            pytest.skip(f"no io_uring on this node ({said})")
        return proc.pid

    def spawn_pidns_tree(self) -> tuple[int, tuple[int, ...]]:
        outer = self._popen(["unshare", "--fork", "--pid", "--kill-child",
                             "sh", "-c", "sleep 60 & sleep 60 & wait"])
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            inits = Path(f"/proc/{outer}/task/{outer}/children").read_text().split()
            if inits:
                root = int(inits[0])
                kids = Path(f"/proc/{root}/task/{root}/children").read_text().split()
                if len(kids) == 2 and {Path(f"/proc/{k}/comm").read_text().strip()
                                       for k in kids} == {"sleep"}:
                    return root, tuple(sorted(int(k) for k in kids))
            time.sleep(0.01)
        raise AssertionError(f"unshare {outer} did not start its namespace")

    def close(self) -> None:
        for proc in self._children:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        for f in self._files:
            f.close()


class FakeHarness(ProcessHarness):
    """The same facts, set up in a ``FakeProcessTable``."""

    def __init__(self, tmp: Path) -> None:
        self.fake = FakeProcessTable(kill_mode="zombie")
        self.table = self.fake
        self.self_pid = 4242
        self.uid = os.getuid()
        self.real = False
        self._tmp = tmp
        self._next = 5000
        self.fake.add_process(1, 0, comm="init")
        self.fake.add_process(4000, 1, comm="bash", uid=self.uid)
        self.fake.add_process(self.self_pid, 4000, comm="pytest", uid=self.uid)

    def _pid(self) -> int:
        self._next += 1
        return self._next

    def spawn(self, ppid: int = 0, comm: str = "sleep") -> int:
        pid = self._pid()
        self.fake.add_process(pid, ppid or self.self_pid, comm=comm, uid=self.uid)
        self.fake.standard_stdio(pid)
        return pid

    def spawn_tree(self) -> tuple[int, tuple[int, ...]]:
        root = self.spawn(comm="sh")
        return root, (self.spawn(root), self.spawn(root))

    def zombie(self) -> int:
        pid = self.spawn()
        self.fake.signal(pid, signal.SIGKILL)
        return pid

    def stopped(self) -> int:
        pid = self.spawn()
        self.fake.signal(pid, signal.SIGSTOP)
        return pid

    def free_pid(self) -> int:
        return self._pid()

    def reuse_pid(self, pid: int) -> int:
        self.fake.signal(pid, signal.SIGKILL)
        self.fake.reap(pid)
        self.fake.add_process(pid, self.self_pid, comm="sleep", uid=self.uid)
        return pid

    def spawn_pidns_tree(self) -> tuple[int, tuple[int, ...]]:
        root = self._pid()
        self.fake.add_process(root, self.self_pid, comm="sh", uid=self.uid, ns_pid=1,
                              namespaces=frozenset({"pid"}))
        kids = []
        for inner in (2, 3):
            kid = self._pid()
            self.fake.add_process(kid, root, comm="sleep", uid=self.uid, ns_pid=inner,
                                  namespaces=frozenset({"pid"}), ns_owner=root,
                                  pidns_init=root)
            kids.append(kid)
        return root, tuple(kids)

    def spawn_io_uring(self, keep: UringKeep) -> int:
        del keep  # a fake process holds one or not
        pid = self._pid()
        self.fake.add_process(pid, self.self_pid, comm="python3", uid=self.uid, io_uring=True)
        return pid

    def spawn_mixed_uid(self, real_uid: int) -> int:
        del real_uid  # a fake process has one uid: the one that decides
        pid = self._pid()
        self.fake.add_process(pid, self.self_pid, comm="python3", uid=0)
        return pid

    def spawn_with_stdout(self, kind: StdoutKind) -> int:
        pid = self.spawn()
        stdin = StdioFact(pid, 0, StdioKind.DEVNULL, "/dev/null", False)
        stderr = StdioFact(pid, 2, StdioKind.DEVNULL, "/dev/null", True)
        if kind == "pipe":
            stdout = StdioFact(pid, 1, StdioKind.PIPE, "pipe:[81234]", True, "pipe:[81234]")
        elif kind == "devnull":
            stdout = StdioFact(pid, 1, StdioKind.DEVNULL, "/dev/null", True)
        else:
            path = str(self._tmp / "stdout.txt")
            stdout = StdioFact(pid, 1, StdioKind.FILE, path, True)
        self.fake.set_stdio(pid, stdin, stdout, stderr)
        return pid


PROCESS_TABLES: dict[str, Callable[[Path], ProcessHarness]] = {
    "procfs": ProcFsHarness,
    "fake": FakeHarness,
}


# ---- BlobStore -------------------------------------------------------------------------------


@dataclass
class BlobStoreHarness:
    blobs: BlobStore
    reopen: Callable[[], BlobStore]
    """Another handle on the same objects (for a durable store: a new instance)."""
    failing_puts: Callable[[], contextlib.AbstractContextManager[None]]
    """A context inside which every put fails part-way through (after writing some bytes)."""
    leave_temporary: Callable[[str], None]
    """Leave what a put cut short by a crash leaves in the directory of ``key`` (nothing for
    a store without temporaries)."""


def _half_write(fd: int, parts: Sequence[Any]) -> None:
    """Writes half of the data, then fails like a full disk."""
    data = b"".join(bytes(p) for p in parts)
    os.write(fd, data[: len(data) // 2])
    raise OSError(errno.ENOSPC, "No space left on device (injected)")


@contextlib.contextmanager
def _local_failing_puts() -> Iterator[None]:
    with mock.patch("ckptd.adapters.storage.localfs._write_all", _half_write):
        yield


def _local_blobs(tmp: Path) -> BlobStoreHarness:
    root = tmp / "blobs"

    def leave_temporary(key: str) -> None:
        directory = (root / key).parent
        directory.mkdir(parents=True, exist_ok=True)
        (directory / ".tmp.0123456789ab").write_bytes(b"half an object")

    return BlobStoreHarness(
        LocalBlobStore(root), lambda: LocalBlobStore(root), _local_failing_puts, leave_temporary
    )


def _memory_blobs(tmp: Path) -> BlobStoreHarness:
    del tmp
    blobs = MemoryBlobStore()

    @contextlib.contextmanager
    def failing_puts() -> Iterator[None]:
        blobs.fail_put_after = 0
        try:
            yield
        finally:
            blobs.fail_put_after = None

    return BlobStoreHarness(blobs, lambda: blobs, failing_puts, lambda key: None)


BLOBSTORES: dict[str, Callable[[Path], BlobStoreHarness]] = {
    "local": _local_blobs,
    "memory": _memory_blobs,
}


# ---- GPUs (GpuInventoryPort and GpuCheckpointer) ---------------------------------------------

import select  # noqa: E402 - this section was appended; its imports live with it
import shutil  # noqa: E402

from ckptd.adapters.cuda import CudaDriverCheckpointer  # noqa: E402
from ckptd.adapters.nvml import NvmlInventory  # noqa: E402
from ckptd.core.ports import GpuCheckpointer, GpuInventoryPort  # noqa: E402
from ckptd.domain import CudaState  # noqa: E402
from ckptd.testing import FakeGpu  # noqa: E402

GPU_WORKLOADS = Path(__file__).resolve().parents[2] / "native" / "gpu"


def exec_done(pid: int, timeout: float = 5.0) -> int:
    """``pid`` once its ``/proc/<pid>/environ`` is the new program's: ``Popen`` may return
    while the kernel is still setting up the exec, and environ reads empty then."""
    environ = Path(f"/proc/{pid}/environ")
    deadline = time.monotonic() + timeout
    while not environ.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    return pid


class GpuHarness:
    """Processes for a GPU port under test: ``spawn_plain`` a child ``sleep`` (no CUDA),
    ``spawn_blind`` one that may use no GPU (``CUDA_VISIBLE_DEVICES`` empty; the fake is told
    so), ``spawn_cuda`` a RUNNING CUDA process that keeps computing (None, with the reason in
    ``no_cuda_reason``, where none can be started), ``progresses`` whether a CUDA process
    goes on computing. ``skip_reason``: why this implementation cannot be tested here."""

    inventory: GpuInventoryPort
    checkpointer: GpuCheckpointer
    real: bool
    skip_reason: str | None = None
    no_cuda_reason = ""

    def __init__(self) -> None:
        self._children: list[subprocess.Popen[bytes]] = []

    def spawn_plain(self) -> int:
        proc = subprocess.Popen(
            ["sleep", "60"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
        )
        self._children.append(proc)
        return proc.pid

    def spawn_blind(self) -> int:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        proc = subprocess.Popen(
            ["sleep", "60"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env
        )
        self._children.append(proc)
        return exec_done(proc.pid)

    def spawn_cuda(self) -> int | None:
        raise NotImplementedError

    def progresses(self, pid: int, timeout: float = 10.0) -> bool:
        """Whether ``pid`` computes on: prints a new step within ``timeout``."""
        raise NotImplementedError

    def close(self) -> None:
        for proc in self._children:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


class FakeGpuHarness(GpuHarness):
    def __init__(self, tmp: Path) -> None:
        super().__init__()
        del tmp
        self.fake = FakeGpu()
        self.inventory = self.fake
        self.checkpointer = self.fake
        self.real = False
        self._next = 9000

    def spawn_blind(self) -> int:
        pid = super().spawn_blind()
        self.fake.set_visible(pid, ())
        return pid

    def spawn_cuda(self) -> int | None:
        self._next += 1
        self.fake.add_cuda_process(self._next, 64 * 2**20)
        return self._next

    def progresses(self, pid: int, timeout: float = 10.0) -> bool:
        del timeout
        return self.fake.cuda_state(pid) is CudaState.RUNNING


class RealGpuHarness(GpuHarness):
    """NVML and the CUDA driver, with ``native/gpu/bin/fill`` as the CUDA process (built with
    ``make -C native/gpu`` on first use)."""

    def __init__(self, tmp: Path) -> None:
        super().__init__()
        del tmp
        self.inventory = NvmlInventory()
        self.real = True
        self._adapter: CudaDriverCheckpointer | None = None
        found = self.inventory.inventory()
        if not found.available:
            self.skip_reason = f"no GPU for the real adapters: {found.message}"
            self.checkpointer = FakeGpu()  # never used: the tests skip
            return
        self._adapter = CudaDriverCheckpointer()
        self.checkpointer = self._adapter
        backend = self._adapter.describe()
        if backend.startswith("unavailable:"):
            self.skip_reason = f"NVML sees a GPU but the CUDA checkpoint API is {backend}"
        self._fill = GPU_WORKLOADS / "bin" / "fill"
        self._outputs: dict[int, IO[bytes]] = {}

    def spawn_cuda(self) -> int | None:
        if not self._fill.exists() and shutil.which("make"):
            subprocess.run(
                ["make", "-C", str(GPU_WORKLOADS)], capture_output=True, timeout=600,
                check=False,
            )
        if not self._fill.exists():
            self.no_cuda_reason = f"no CUDA workload: {self._fill} not built (needs nvcc)"
            return None
        proc = subprocess.Popen(
            [str(self._fill), "--steps", "0", "--interval-ms", "20", "--mib", "64"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, bufsize=0,
        )
        self._children.append(proc)
        assert proc.stdout is not None
        self._outputs[proc.pid] = proc.stdout  # unbuffered: select() sees every byte
        if not self._line(proc.pid, 60.0):
            raise AssertionError(f"{self._fill} printed no step within 60 s")
        return proc.pid

    def _line(self, pid: int, timeout: float) -> bool:
        out = self._outputs[pid]
        ready, _, _ = select.select([out], [], [], timeout)
        return bool(ready) and out.readline().startswith(b"step ")

    def progresses(self, pid: int, timeout: float = 10.0) -> bool:
        """A new step line within ``timeout``, after dropping what was printed up to now (and
        during a short grace period: a step whose CUDA calls ended just before a lock may
        still print)."""
        out = self._outputs[pid]
        for _ in range(2):
            while select.select([out], [], [], 0)[0]:
                if not out.readline():
                    return False
            time.sleep(0.2)
        return self._line(pid, timeout)

    def close(self) -> None:
        super().close()
        if self._adapter is not None:
            self._adapter.close()


GPUS: dict[str, Callable[[Path], GpuHarness]] = {
    "fake": FakeGpuHarness,
    "real": RealGpuHarness,
}


# ---- BlobStore on S3 (appended section: a real S3 API, moto's server on 127.0.0.1) ----------

from ckptd.adapters.storage import ObjectBlobStore  # noqa: E402

from . import moto_server  # noqa: E402


def _s3_blobs(tmp: Path) -> BlobStoreHarness:
    """``ObjectBlobStore`` on a fresh bucket of the session's moto server. Failed puts: the
    store's requests go to a loopback port that reads part of each request and hangs up."""
    del tmp
    missing = moto_server.moto_missing()
    if missing is not None:
        pytest.skip(missing)
    server = moto_server.shared()
    url = f"s3://{server.new_bucket()}/ckptd"

    def open_store(endpoint: str = server.endpoint, **opts: Any) -> ObjectBlobStore:
        return ObjectBlobStore.from_url(
            url, endpoint=endpoint, region=moto_server.REGION, allow_http=True,
            config=moto_server.STORE_CREDENTIALS, **opts,
        )

    blobs = open_store()

    @contextlib.contextmanager
    def failing_puts() -> Iterator[None]:
        with moto_server.dropping_server() as dead:
            broken = open_store(
                dead.endpoint, connect_timeout=2.0, timeout=5.0, max_retries=1,
                retry_timeout=5.0, init_backoff=0.01, max_backoff=0.05,
            )
            healthy, blobs._store = blobs._store, broken._store
            try:
                yield
            finally:
                blobs._store = healthy
            assert dead.connections > 0, "no request reached the failing endpoint"

    return BlobStoreHarness(blobs, open_store, failing_puts, lambda key: None)


BLOBSTORES["s3"] = _s3_blobs
