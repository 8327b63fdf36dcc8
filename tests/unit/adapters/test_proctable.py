"""ProcFsTable reads /proc: the session id, kernel threads and tracing from stat/status."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptd.adapters.procfs.pidfd import PF_EXITING, state_of
from ckptd.adapters.procfs.proctable import ProcFsTable
from ckptd.domain import PidState


def fake_proc(root: Path, pid: int, *, comm: str, state: str, ppid: int, session: int) -> Path:
    base = root / str(pid)
    base.mkdir(parents=True)
    fields = [state, ppid, pid, session, 0, -1, 0] + [0] * 30
    (base / "stat").write_text(f"{pid} ({comm}) {' '.join(map(str, fields))}\n")
    (base / "status").write_text("Uid:\t1000\t1000\t1000\t1000\nTracerPid:\t0\n")
    return root


def test_session_zero_is_read_from_stat(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, 4242, comm="a job (x)", state="S", ppid=1, session=0)
    status = ProcFsTable(proc).status(4242)
    assert status.state is PidState.RUNNING
    assert (status.comm, status.ppid, status.uid, status.session) == ("a job (x)", 1, 1000, 0)


def test_own_session_is_read_from_the_real_proc() -> None:
    status = ProcFsTable().status(os.getpid())
    assert status.session == os.getsid(0)


def test_a_process_dying_while_read_is_gone_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading /proc/PID/status of a process that is exiting can fail with ESRCH."""
    proc = fake_proc(tmp_path, 4243, comm="dying", state="S", ppid=1, session=7)
    real = Path.read_text

    def read_text(self: Path, *args: object, **kwargs: object) -> str:
        if self.name == "status":
            raise ProcessLookupError(3, "No such process")
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", read_text)
    assert ProcFsTable(proc).status(4243).state is PidState.FREE
    assert ProcFsTable(proc)._fact(4243) is None


def test_a_task_in_exit_counts_as_a_zombie() -> None:
    """PF_EXITING: the task runs no user code again (its memory may be gone already), though
    /proc still says R or D until it is a zombie."""
    fields = ["42", "job", "R", "1", "42", "42", "0", "-1", "4194304"]
    assert state_of(fields) is PidState.RUNNING
    fields[8] = str(4194304 | PF_EXITING)
    assert state_of(fields) is PidState.ZOMBIE
    fields[2], fields[8] = "T", "4194304"
    assert state_of(fields) is PidState.STOPPED
