"""ProcFsTable reads /proc: the session id, kernel threads and tracing from stat/status."""

from __future__ import annotations

import os
from pathlib import Path

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
