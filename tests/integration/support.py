"""Helpers of the integration tier: the real daemon and CLI as subprocesses, /proc, workloads.

Nothing here fakes anything: ``Daemon`` runs ``.venv/bin/ckptd``, ``Daemon.ctl`` runs
``.venv/bin/ckptctl --json``, processes are real and are looked at through /proc. Every wait
has a deadline; a helper that gives up raises ``AssertionError`` saying what it waited for.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import termios
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ckptd.daemon.config import DEFAULT_CRIU_PATHS

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
CKPTD = VENV_BIN / "ckptd"
CKPTCTL = VENV_BIN / "ckptctl"
VENV_PYTHON = VENV_BIN / "python"
WORKLOADS_DIR = REPO / "native" / "workloads"
WORKLOADS_BIN = WORKLOADS_DIR / "bin"

NOBODY = 65534
CTL_TIMEOUT_S = 90.0
TEST_CGROUPS = f"/ckptd-tests-{os.getpid()}"
"""This session's cgroup (v2 path): each daemon's ``jobs_cgroup`` is a child of it (never
the default /ckptd-jobs of the host); removed when the session's process exits
(``remove_test_cgroups``)."""


# ---- /proc ------------------------------------------------------------------------------------


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat split, ``comm`` as field 1 (it may hold spaces); None if no such pid."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    lpar, rpar = raw.index("("), raw.rindex(")")
    return [raw[:lpar].strip(), raw[lpar + 1 : rpar], *raw[rpar + 2 :].split()]


def proc_state(pid: int) -> str | None:
    """The state letter of /proc/PID/stat (R, S, D, T, t, Z, ...); None when the pid is free."""
    fields = stat_fields(pid)
    return fields[2] if fields else None


SIGSTOP_BIT = 1 << (19 - 1)


def _stopped_or_stopping(pid: int) -> bool:
    if proc_state(pid) in ("T", "t"):
        return True
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    pending = 0
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("SigPnd", "ShdPnd"):
            pending |= int(value, 16)
    return bool(pending & SIGSTOP_BIT)


def assert_held(*pids: int) -> None:
    """Every pid is held: stopped, or SIGSTOP pending. CRIU's ``--leave-stopped`` detaches
    each task with SIGSTOP pending; it stops before it runs a user instruction again, but
    /proc says "R" until the scheduler has run it into the stop, which on a loaded machine
    comes after the RPC returned. (The brief moment between the kernel taking the signal
    and the stop is tried again for up to 2 s.)"""
    deadline = time.monotonic() + 2.0
    while True:
        loose = [p for p in pids if not _stopped_or_stopping(p)]
        if not loose:
            return
        assert time.monotonic() < deadline, (
            f"not held: {[(p, proc_state(p)) for p in loose]} neither stopped nor SIGSTOP pending")
        time.sleep(0.01)


def is_alive(pid: int) -> bool:
    """Exists and is not a zombie."""
    state = proc_state(pid)
    return state is not None and state not in ("Z", "X")


def assert_running(pid: int, what: str = "") -> None:
    """The process exists, is not a zombie and is not stopped (job control or ptrace)."""
    state = proc_state(pid)
    assert state is not None, f"pid {pid} {what} is gone"
    assert state not in ("T", "t"), f"pid {pid} {what} is left stopped (state {state})"
    assert state not in ("Z", "X"), f"pid {pid} {what} is a zombie"


def uid_line(pid: int) -> list[int]:
    """Real, effective, saved and filesystem uid from /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return [int(x) for x in line.split()[1:]]
    raise AssertionError(f"no Uid: line for pid {pid}")


def io_wchar(pid: int) -> int:
    """Bytes the process has passed to write(2) (/proc/PID/io), also those to /dev/null."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError(f"no wchar in /proc/{pid}/io")


def children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return kids
    for task in tasks:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            kids.extend(int(c) for c in (task / "children").read_text().split())
    return kids


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    queue = children(pid)
    while queue:
        child = queue.pop(0)
        out.append(child)
        queue.extend(children(child))
    return out


def wait_until(predicate: Any, timeout: float, what: str, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def wait_state(pid: int, states: Iterable[str | None], timeout: float = 10.0) -> None:
    wanted = set(states)
    wait_until(lambda: proc_state(pid) in wanted, timeout, f"pid {pid} in state {wanted}")


def free_pid() -> int:
    """A pid no process holds: one of a child that has exited and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait(timeout=10)
    assert proc_state(child.pid) is None
    return child.pid


# ---- processes the tests start ----------------------------------------------------------------


def start_time(pid: int) -> int | None:
    """When the process started (clock ticks after boot): tells a pid's holders apart."""
    fields = stat_fields(pid)
    return int(fields[21]) if fields else None


class Procs:
    """Processes a test started or restored; all SIGKILLed (with their descendants) at the
    end of the test. Restored processes are not our children (they are reparented to init),
    so they are killed by pid; ``Popen`` children are also reaped. A pid is killed only if it
    is still held by the process registered (same start time), never by a newcomer."""

    def __init__(self) -> None:
        self._pids: list[tuple[int, int | None]] = []
        self._popens: list[subprocess.Popen[Any]] = []

    def add(self, pid: int) -> int:
        """Register the process that holds ``pid`` now (a restored one: after the restore)."""
        if pid > 1 and pid != os.getpid():
            self._pids.append((pid, start_time(pid)))
        return pid

    def popen(self, *args: Any, **kwargs: Any) -> subprocess.Popen[Any]:
        """``subprocess.Popen`` whose process (and descendants) are killed at teardown.

        The process starts in a session of its own unless told otherwise, as under a real
        job launcher (a login shell, systemd, a container runtime): CI runs under an init
        that never called setsid, and CRIU refuses a task in session 0 (that refusal has
        its own test)."""
        kwargs.setdefault("start_new_session", True)
        proc: subprocess.Popen[Any] = subprocess.Popen(*args, **kwargs)
        self._popens.append(proc)
        self.add(proc.pid)
        return proc

    def cleanup(self) -> None:
        victims: list[int] = []
        for pid, started in self._pids:
            if started is not None and start_time(pid) == started:
                victims.extend([*descendants(pid), pid])
        for pid in victims:
            if is_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self._popens:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        deadline = time.monotonic() + 5.0
        for pid in victims:
            while is_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)


def start_detached(
    procs: Procs, cmd: Sequence[object], out: Path,
    preexec_fn: Callable[[], None] | None = None,
) -> int:
    """Start ``cmd`` as a launcher does: a shell in a session of its own puts it in the
    background (stdout appended to ``out``) and exits, so the job is nobody's child here and
    nothing of the test holds its zombie when a dump kills it. Returns the job's pid."""
    sh = procs.popen(
        ["sh", "-c", '"$@" >>"$OUT" 2>/dev/null </dev/null & echo $!', "sh", *map(str, cmd)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "OUT": str(out)},
        preexec_fn=preexec_fn,
    )
    return procs.add(int(sh.communicate(timeout=10)[0]))


def spawn_shell_job_on_pty(procs: Procs, cmd: list[str]) -> tuple[int, int]:
    """``sh -c 'set -m; prog &'`` as a session leader whose controlling terminal is a new
    pty: prog is a background job (own process group) writing to the terminal; sh exits.
    Returns (pty master fd, prog's pid).

    ``set -m`` is what an interactive shell does: without job control the job would stay in
    sh's process group, the terminal's foreground group, and the kernel sends that group
    SIGHUP when the session leader (sh) exits."""
    master, slave = os.openpty()

    def make_controlling_tty() -> None:
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    script = 'set -m; "$@" & echo $! >&2'
    try:
        sh = procs.popen(
            ["sh", "-c", script, "sh", *cmd], stdin=slave, stdout=slave,
            stderr=subprocess.PIPE, start_new_session=True, preexec_fn=make_controlling_tty,
        )
    finally:
        os.close(slave)
    assert sh.stderr is not None
    pid = int(sh.stderr.readline())
    procs.add(pid)
    assert sh.wait(timeout=10) == 0
    return master, pid


# ---- workloads --------------------------------------------------------------------------------


def workload(name: str, *args: object) -> list[str]:
    """The command line of a workload of native/workloads."""
    if name == "pyloop.py":
        return [str(VENV_PYTHON), str(WORKLOADS_DIR / "pyloop.py"), *map(str, args)]
    return [str(WORKLOADS_BIN / name), *map(str, args)]


def reference(cmd: Sequence[str], timeout: float = 60.0) -> list[str]:
    """The output lines of an uninterrupted run (run it with ``--interval-ms 0``)."""
    out = subprocess.run(
        list(cmd), capture_output=True, text=True, timeout=timeout, check=True,
        stdin=subprocess.DEVNULL,
    ).stdout
    lines = out.splitlines()
    assert lines and lines[-1].startswith("done "), f"reference run ended oddly: {lines[-3:]}"
    return lines


def with_interval(cmd: Sequence[str], interval_ms: int) -> list[str]:
    return [*cmd, "--interval-ms", str(interval_ms)]


def step_of(line: str) -> int:
    parts = line.split()
    assert len(parts) == 3 and parts[0] == "step", f"not a step line: {line!r}"
    return int(parts[1])


def assert_same_lines(got: list[str], want: list[str], what: str) -> None:
    if got == want:
        return
    first = next(
        (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
        min(len(got), len(want)),
    )
    raise AssertionError(
        f"{what}: {len(got)} lines, expected {len(want)}; first difference at line {first + 1}: "
        f"got {got[first : first + 3]!r}, expected {want[first : first + 3]!r}"
    )


def assert_continuity(pre: list[str], post: list[str], ref: list[str]) -> None:
    """Output before the dump + output of the restored process == the uninterrupted run."""
    assert pre, "the workload printed nothing before the dump"
    assert post, "the restored process printed nothing"
    assert not pre[-1].startswith("done"), "the workload had finished before the dump"
    assert_same_lines(pre + post, ref, "output before the dump + after the restore")


def assert_continues_from_dump_point(
    post: list[str], ref: list[str], low: int, high: int
) -> int:
    """For a checkpoint taken with --leave-running: ``post`` (the restored process's output)
    is the reference from the step after the dump point to the end, and the dump point lies
    between ``low`` lines (printed before the dump was asked for) and ``high`` lines (printed
    when it had returned). Returns the number of lines before the dump point."""
    assert post, "the restored process printed nothing"
    point = step_of(post[0]) - 1
    assert low <= point <= high, (
        f"restored process starts at step {point + 1}, but {low} lines were printed before "
        f"the dump and {high} when it returned"
    )
    assert_same_lines(post, ref[point:], f"output of the process restored at step {point + 1}")
    return point


# ---- reading output with deadlines -----------------------------------------------------------


class LineReader:
    """Lines from a pipe, socket or pty master fd, with deadlines. A pty's ``\\r\\n`` is read
    as ``\\n``; EIO from a pty master (no slave left) is end of file."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buf = b""
        self.eof = False
        self.lines: list[str] = []

    def _fill(self, timeout: float) -> bool:
        if self.eof:
            return False
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        if not ready:
            return False
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO on a pty master: every slave closed
            data = b""
        if not data:
            self.eof = True
            return False
        self._buf += data.replace(b"\r\n", b"\n")
        *complete, self._buf = self._buf.split(b"\n")
        self.lines.extend(c.decode() for c in complete)
        return True

    def read_lines(self, n: int, timeout: float = 15.0) -> list[str]:
        """Read until at least ``n`` lines in all have been read; returns all read so far."""
        deadline = time.monotonic() + timeout
        while len(self.lines) < n:
            if self.eof:
                raise AssertionError(f"end of output after {len(self.lines)} lines, wanted {n}")
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout:g}s with {len(self.lines)} lines, wanted {n}"
                )
            self._fill(deadline - time.monotonic())
        return list(self.lines)

    def drain(self) -> list[str]:
        """Whatever can be read right now, without waiting."""
        while self._fill(0.0):
            pass
        return list(self.lines)

    def read_to_eof(self, timeout: float = 15.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while not self.eof:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout:g}s waiting for end of output "
                    f"({len(self.lines)} lines read)"
                )
            self._fill(deadline - time.monotonic())
        assert not self._buf, f"output ends with a partial line {self._buf!r}"
        return list(self.lines)


def read_lines_file(path: Path) -> list[str]:
    return path.read_bytes().replace(b"\r\n", b"\n").decode().splitlines()


def wait_for_done(path: Path, timeout: float = 30.0) -> list[str]:
    """The lines of ``path`` once a complete ``done`` line is there."""
    deadline = time.monotonic() + timeout
    text = b""
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            text = path.read_bytes().replace(b"\r\n", b"\n")
            lines = text.decode().split("\n")
            if len(lines) >= 2 and lines[-2].startswith("done "):
                return lines[:-1]
        time.sleep(0.05)
    tail = text.decode(errors="replace").splitlines()[-3:]
    raise AssertionError(f"no 'done' line in {path} after {timeout:g}s; it ends with {tail!r}")


def wait_for_lines(path: Path, n: int, timeout: float = 15.0) -> list[str]:
    deadline = time.monotonic() + timeout
    lines: list[str] = []
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            data = path.read_bytes().replace(b"\r\n", b"\n").decode()
            lines = data.split("\n")[:-1]  # complete lines only
            if len(lines) >= n:
                return lines
        time.sleep(0.02)
    raise AssertionError(f"{path} has {len(lines)} lines after {timeout:g}s, wanted {n}")


# ---- cgroups ---------------------------------------------------------------------------------


def cgroup_v2_mount() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted at its root (as the daemon finds it)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if " - cgroup2 " in line and fields[3] == "/":
            return Path(fields[4])
    return None


def cgroup_of(pid: int) -> str:
    """The ``0::`` path of /proc/PID/cgroup."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise AssertionError(f"pid {pid} is in no cgroup v2")


def remove_test_cgroups() -> None:
    """Remove ``TEST_CGROUPS`` and everything below it that is empty (deepest first)."""
    mount = cgroup_v2_mount()
    if mount is None:
        return
    top = mount / TEST_CGROUPS.lstrip("/")
    if not top.is_dir():
        return
    dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
    for d in [*dirs, top]:
        with contextlib.suppress(OSError):
            d.rmdir()


atexit.register(remove_test_cgroups)  # every tier whose daemons come from here


# ---- the daemon and the CLI -------------------------------------------------------------------


class CtlResult(NamedTuple):
    """What a ``ckptctl --json`` run gave: exit code, parsed JSON (or the raw text when stdout
    is not JSON, e.g. on failure), and stderr."""

    rc: int
    out: Any
    err: str


def _as_uid(uid: int | None) -> dict[str, Any]:
    """``subprocess`` arguments that run the child as ``uid`` (its group too, no others), and
    with an interpreter and a copy of ckptd that uid can use (see ``cli_for_uid``)."""
    if uid is None:
        return {}
    env = {**os.environ, **cli_for_uid(uid)[1]}
    return {"user": uid, "group": uid, "extra_groups": [], "env": env}


def _ckptctl_argv(uid: int | None) -> list[str]:
    return [str(CKPTCTL)] if uid is None else cli_for_uid(uid)[0]


@functools.cache
def cli_for_uid(uid: int) -> tuple[list[str], dict[str, str]]:
    """How to run ckptctl as ``uid``: (argv prefix, extra environment).

    ``.venv/bin/ckptctl`` may not work for another uid: the venv's interpreter may live under
    a root-only home (pyenv in /root). Then a system python of the same version runs the
    CLI from the venv's site-packages. If the checkout itself is not readable by that uid
    (ckptd/_gen left 0700 by scripts/gen-protos.sh), a world-readable copy of the ckptd
    package is used, with a warning: the CLI code is the same, only its location differs."""
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    site = REPO / ".venv" / "lib" / f"python{version}" / "site-packages"
    candidates = [str(Path(sys.executable).resolve()), f"/usr/bin/python{version}"]

    def runs(python: str, pythonpath: str, code: str) -> bool:
        try:
            return subprocess.run(
                [python, "-c", code], user=uid, group=uid, extra_groups=[], cwd="/",
                env={**os.environ, "PYTHONPATH": pythonpath}, capture_output=True,
                timeout=60, check=False,
            ).returncode == 0
        except OSError:
            return False

    python = next((c for c in candidates if runs(c, "", "pass")), None)
    if python is None:
        raise AssertionError(f"no Python {version} that uid {uid} may run: tried {candidates}")
    pythonpath = f"{REPO}:{site}"
    if not runs(python, pythonpath, "import ckptd.transport.cli.main"):
        copy = Path(tempfile.mkdtemp(prefix="ckptd-it-cli-"))
        atexit.register(shutil.rmtree, copy, True)
        shutil.copytree(REPO / "ckptd", copy / "ckptd",
                        ignore=shutil.ignore_patterns("__pycache__"))
        for path in [copy, *copy.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        warnings.warn(
            f"uid {uid} cannot import ckptd from {REPO} (a directory of the checkout is not "
            f"readable by others, e.g. ckptd/_gen made 0700 by scripts/gen-protos.sh); "
            f"running its ckptctl from a readable copy in {copy}",
            stacklevel=2,
        )
        pythonpath = f"{copy}:{site}"
        if not runs(python, pythonpath, "import ckptd.transport.cli.main"):
            raise AssertionError(f"uid {uid} cannot import ckptd even from {copy}")
    return [python, "-m", "ckptd.transport.cli"], {"PYTHONPATH": pythonpath}


def run_ckptctl(
    socket_path: Path, *args: object, user: int | None = None, timeout: float = CTL_TIMEOUT_S
) -> CtlResult:
    cmd = [*_ckptctl_argv(user), "--socket", str(socket_path), "--json", *map(str, args)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
        cwd="/", check=False, **_as_uid(user),
    )
    out: Any = proc.stdout
    with contextlib.suppress(ValueError):
        out = json.loads(proc.stdout)
    return CtlResult(proc.returncode, out, proc.stderr)


def ckptctl_popen(
    socket_path: Path, *args: object, user: int | None = None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*_ckptctl_argv(user), "--socket", str(socket_path), "--json", *map(str, args)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        cwd="/", **_as_uid(user),
    )


def assert_ok(res: CtlResult, what: str) -> Any:
    assert res.rc == 0, f"ckptctl {what} failed (exit {res.rc}): {res.err.strip()}"
    assert not isinstance(res.out, str), f"ckptctl {what} printed no JSON: {res.out!r}"
    return res.out


def assert_one_line_error(res: CtlResult, rc: int, *needles: str) -> str:
    """A failure: exit code ``rc``, nothing on stdout, exactly one ``ckptctl: ...`` line on
    stderr containing every needle (case-insensitive). Returns that line."""
    assert res.rc == rc, f"expected exit {rc}, got {res.rc}; stderr {res.err!r}"
    assert res.out == "", f"expected nothing on stdout, got {res.out!r}"
    lines = res.err.splitlines()
    assert len(lines) == 1 and res.err.endswith("\n"), f"stderr is not one line: {res.err!r}"
    line = lines[0]
    assert line.startswith("ckptctl: "), line
    for needle in needles:
        assert needle.lower() in line.lower(), f"{needle!r} not in {line!r}"
    return line


def manifest_keys_of(root: Path) -> Path:
    """The manifest key file a test daemon under ``root`` is given unless the test names
    one: one file for every daemon of the session (their roots are siblings)."""
    return root.parent / "manifest.keys"


class Daemon:
    """A ``ckptd`` subprocess with its own socket, store and state directory under ``root``."""

    def __init__(
        self,
        root: Path,
        *extra: str,
        config: dict[str, Any] | None = None,
        socket_dir: Path | None = None,
        socket_name: str = "ckptd.sock",
        preexec_fn: Callable[[], None] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.root = root
        self.socket = (socket_dir or root / "run") / socket_name
        self.store = root / "store"
        self.state_dir = root / "state"
        self.log_path = root / "ckptd.log"
        args = [
            str(CKPTD), "--socket", str(self.socket), "--store", str(self.store),
            "--state-dir", str(self.state_dir), *extra,
        ]
        if "--manifest-keys" not in extra and "manifest_keys" not in (config or {}):
            # one key file for every daemon of the session, as for the nodes of a shared
            # store (created by the first daemon that starts)
            args += ["--manifest-keys", str(manifest_keys_of(root))]
        self.jobs_cgroup = f"{TEST_CGROUPS}/{root.name}"
        if "--jobs-cgroup" not in extra and "jobs_cgroup" not in (config or {}):
            args += ["--jobs-cgroup", self.jobs_cgroup]
        if config:
            root.mkdir(parents=True, exist_ok=True)
            conf = root / "ckptd.toml"
            conf.write_text(
                "".join(f"{k} = {json.dumps(v)}\n" for k, v in config.items())
            )
            args += ["--config", str(conf)]
        root.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd="/",
                preexec_fn=preexec_fn, env=env,  # noqa: PLW1509 (setns only)
            )
        self._wait_ready()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"ckptd exited with {self.proc.returncode} at start:\n{self.log()}"
                )
            if self.socket.is_socket() and "serving on" in self.log():
                return
            time.sleep(0.05)
        self.proc.kill()
        self.proc.wait()
        raise AssertionError(f"ckptd did not start serving within {timeout:g}s:\n{self.log()}")

    def ctl(self, *args: object, user: int | None = None, timeout: float = CTL_TIMEOUT_S
            ) -> CtlResult:
        return run_ckptctl(self.socket, *args, user=user, timeout=timeout)

    def popen(self, *args: object, user: int | None = None) -> subprocess.Popen[str]:
        return ckptctl_popen(self.socket, *args, user=user)

    def checkpoints_of(self, pid: int) -> list[dict[str, Any]]:
        listed = assert_ok(self.ctl("list", "--pid", pid), "list")
        assert isinstance(listed, list)
        return listed

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then its exit code (killed after ``timeout``: then the code is negative)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def criu_path() -> str | None:
    """The CRIU the tier uses: $CKPTD_TEST_CRIU, else the daemon's default search."""
    for cand in (os.environ.get("CKPTD_TEST_CRIU", ""), *DEFAULT_CRIU_PATHS):
        if cand and os.access(cand, os.X_OK):
            return cand
    return shutil.which("criu")


def stop_cleanly(daemon: Daemon) -> None:
    """SIGTERM ``daemon``; it must exit 0 (its log's tail in the failure otherwise)."""
    rc = daemon.stop()
    assert rc == 0, f"ckptd exited {rc} after SIGTERM; its log:\n{daemon.log()[-4000:]}"


@contextlib.contextmanager
def running_daemon(root: Path, *flags: str, **kwargs: Any) -> Iterator[Daemon]:
    """The one way the tier starts a daemon: in ``root``, on the tier's CRIU unless ``flags``
    name one (``kwargs``: ``Daemon``'s, e.g. ``config``), stopped cleanly at the end."""
    path = criu_path()
    criu = [] if path is None or "--criu" in flags else ["--criu", path]
    d = Daemon(root, *criu, *flags, **kwargs)
    try:
        yield d
    finally:
        stop_cleanly(d)
