"""``ProcCudaFacts``: the ``CudaProcessFacts`` port over /proc.

Per pid: whether a ``libnccl`` shared object is mapped (a path in ``/proc/<pid>/maps``
whose file name starts with ``libnccl``: ``libnccl.so.2``, PyTorch's bundled
``libnccl-<hash>.so.2``; NCCL linked statically into a binary is not seen), and
``CUDA_CHECKPOINT_JOB_FILE`` in the environment it started with (``/proc/<pid>/environ``: a
variable set later by the process itself is not seen).

Limits, said once: CUDA IPC (``cuIpcGetMemHandle`` / ``cuIpcOpenMemHandle``) and UVM
(``cudaMallocManaged``) leave nothing in /proc that tells them apart from plain device
memory — every CUDA process maps ``/dev/nvidia-uvm`` and ``/dev/nvidia<N>`` — so this
adapter reports neither; ckptd leaves them to the driver's own refusal, which
``ckptd.core.gpu.GpuSteps`` translates into what would work.

Invariant: ``cuda_facts`` never raises; /proc that cannot be read gives a fact with
``unreadable`` set and nothing else.
"""

from __future__ import annotations

from pathlib import Path

from ckptd.core.ports import CudaProcessFact

JOB_FILE_VAR = "CUDA_CHECKPOINT_JOB_FILE"


class ProcCudaFacts:
    """The ``CudaProcessFacts`` port (``ckptd.core.ports``). ``proc``: where /proc is."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc

    def cuda_facts(self, pid: int) -> CudaProcessFact:
        base = self._proc / str(pid)
        try:
            maps = (base / "maps").read_bytes()
            environ = (base / "environ").read_bytes()
        except OSError as exc:
            return CudaProcessFact(
                pid, unreadable=f"{exc.strerror or exc} ({exc.filename})"
            )
        return CudaProcessFact(pid, nccl=maps_nccl(maps), launch_job=job_file(environ))


def maps_nccl(maps: bytes) -> bool:
    """Whether ``/proc/<pid>/maps`` (its text) maps a file named ``libnccl*``."""
    for line in maps.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5].rsplit(b"/", 1)[-1].startswith(b"libnccl"):
            return True
    return False


def job_file(environ: bytes) -> str:
    """``CUDA_CHECKPOINT_JOB_FILE``'s value in ``/proc/<pid>/environ`` ("" when unset; the
    last one wins, as getenv's callers see it in practice)."""
    found = ""
    prefix = JOB_FILE_VAR.encode() + b"="
    for item in environ.split(b"\0"):
        if item.startswith(prefix):
            found = item[len(prefix):].decode(errors="replace") or "(empty)"
    return found
