"""Issue 21: root acts on paths that users control, tried as an attacker would.

A real unprivileged user (created here) owns a directory on the path of the files a root job
writes; between the checkpoint and the restore it swaps what it can — a directory for a
symbolic link to a root-only one, a missing file for a link while the restore creates it —
and each time the restore either puts the files back where the job wrote them or refuses in
one line; no root file elsewhere is ever written, handed over, or read through an aside copy.
Also: aside copies are 0600 and the file owner's, a daemon SIGKILLed during the put-back
leaves every file as it found it (its successor finishes the undo from the journal), and
``restore --output`` never overwrites what a file held nor opens a /proc magic link.
Real CRIU, the real daemon and CLI.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import criu_path
from .store_support import Daemons
from .support import CKPTCTL, Daemon, Procs, assert_ok, assert_one_line_error, wait_until

pytestmark = pytest.mark.integration

ATTACKER = "ckptd-attacker"
USER_PYTHON = "/usr/bin/python3"
"""An interpreter any user may run (the venv's may live under a root-only home)."""
WRITER = ("import sys, time\n"
          "held = [open(p[1:], 'r+b') for p in sys.argv[2:] if p[0] == '=']\n"
          "files = [open(p, 'ab', buffering=0) for p in sys.argv[2:] if p[0] != '=']\n"
          "for i in range(int(sys.argv[1])):\n"
          "    for f in files: f.write(b'step %d\\n' % i)\n"
          "    sys.stdout.write('step %d\\n' % i); sys.stdout.flush()\n"
          "    time.sleep(0.02)\n"
          "time.sleep(600)\n")


@pytest.fixture(scope="module")
def attacker() -> Iterator[int]:
    """A real unprivileged user, created for these tests (and removed after)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a user")
    created = False
    try:
        pwd.getpwnam(ATTACKER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/false",
                        ATTACKER], check=True)
        created = True
    try:
        yield pwd.getpwnam(ATTACKER).pw_uid
    finally:
        if created:
            subprocess.run(["userdel", ATTACKER], check=False)


@pytest.fixture
def area(attacker: int) -> Iterator[Path]:
    """A directory every user may traverse (pytest's tmp_path is root's 0700)."""
    path = Path(tempfile.mkdtemp(prefix="ckptd-paths-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def as_user(uid: int, code: str, *args: object, wait: bool = True) -> subprocess.Popen[bytes]:
    """Python ``code`` run as ``uid`` (no supplementary groups)."""
    proc = subprocess.Popen([USER_PYTHON, "-c", code, *map(str, args)], user=uid,
                            group=uid, extra_groups=[], cwd="/",
                            stdin=subprocess.DEVNULL)
    if wait:
        assert proc.wait(timeout=60) == 0, f"as uid {uid}: {code!r} failed"
    return proc


def user_dir(area: Path, uid: int, name: str = "home") -> Path:
    home = area / name
    home.mkdir()
    os.chown(home, uid, uid)
    return home


def secret(area: Path, content: bytes = b"precious\n") -> Path:
    """A root-only directory holding a root 0600 file: what an attacker wants."""
    vault = area / "vault"
    vault.mkdir(mode=0o700)
    target = vault / "job.log"
    target.write_bytes(content)
    target.chmod(0o600)
    return target


def run_job(procs: Procs, *paths: Path | str, steps: int = 60) -> subprocess.Popen[bytes]:
    return procs.popen([sys.executable, "-c", WRITER, str(steps), *map(str, paths)],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, start_new_session=True)


def lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


def checkpoint_then_crash(
    daemon: Daemon, procs: Procs, *paths: Path, held: Path | None = None
) -> dict[str, object]:
    """A root job writing ``paths`` (and holding ``held`` open for writing, unwritten): a
    leave-running checkpoint, more steps, kill -9."""
    job = run_job(procs, *paths, *([f"={held}"] if held else []))
    wait_until(lambda: lines(paths[0]) >= 3, 30, "the job's first steps")
    ck = assert_ok(daemon.ctl("dump", job.pid, "--leave-running"), "dump --leave-running")
    seen = lines(paths[0])
    wait_until(lambda: lines(paths[0]) >= seen + 3, 30, "steps after the checkpoint")
    job.send_signal(signal.SIGKILL)
    job.wait(timeout=10)
    assert isinstance(ck, dict)
    return ck


def test_a_directory_swapped_for_a_symlink_is_refused_and_never_followed(
    daemon: Daemon, procs: Procs, area: Path, attacker: int
) -> None:
    home = user_dir(area, attacker)
    data = home / "data"  # root's, but in the attacker's directory: it can be renamed
    data.mkdir()
    target = secret(area)
    ck = checkpoint_then_crash(daemon, procs, data / "job.log")
    as_user(attacker, "import os, sys; os.rename(sys.argv[1], sys.argv[1] + '.old'); "
            "os.symlink(sys.argv[2], sys.argv[1])", data, target.parent)

    report = daemon.ctl("check-restore", ck["id"])
    assert report.rc != 0 and report.out["compatible"] is False, report
    assert any("symbolic link" in b for b in report.out["blocking"]), report.out
    res = daemon.ctl("restore", ck["id"])
    assert_one_line_error(res, res.rc, "symbolic link")
    assert target.read_bytes() == b"precious\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["job.log"]


def test_a_file_created_at_restore_is_never_handed_over_through_a_swapped_link(
    daemon: Daemon, procs: Procs, area: Path, attacker: int
) -> None:
    """The attacker's own file, written by a root job, is gone at restore: ckptd creates it
    (and gives it to the attacker) while the attacker swaps a link to a root file in and out
    of its name as fast as it can."""
    home = user_dir(area, attacker)
    out = home / "out.log"
    out.touch()
    os.chown(out, attacker, attacker)
    target = secret(area)
    ck = checkpoint_then_crash(daemon, procs, out)
    racer = as_user(attacker, (
        "import os, sys, time\n"
        "end = time.monotonic() + 60\n"
        "while time.monotonic() < end:\n"
        "    try: os.unlink(sys.argv[1])\n"
        "    except FileNotFoundError: pass\n"
        "    try: os.symlink(sys.argv[2], sys.argv[1])\n"
        "    except FileExistsError: pass\n"), out, target, wait=False)
    try:
        restored = 0
        for _ in range(6):
            res = daemon.ctl("restore", ck["id"])
            if res.rc == 0:
                restored += 1
                procs.add(res.out["pid"])
                os.kill(res.out["pid"], signal.SIGKILL)
            st = target.stat()
            assert (st.st_uid, st.st_mode & 0o777) == (0, 0o600), "a root file was handed over"
            assert target.read_bytes() == b"precious\n"
    finally:
        racer.kill()
        racer.wait()
    assert [p.name for p in target.parent.iterdir()] == ["job.log"]


def test_aside_copies_are_0600_the_owners_and_unreadable_to_others(
    daemon: Daemon, procs: Procs, area: Path, attacker: int
) -> None:
    """At the checkpoint the job's files are 0644; afterwards one becomes a 0600 secret.
    The versions found at restore are kept aside: 0600, owned by each file's owner."""
    work = area / "work"
    work.mkdir()
    root_file = work / "root.log"
    users_file = work / "users.log"
    users_file.touch()
    os.chown(users_file, attacker, attacker)
    ck = checkpoint_then_crash(daemon, procs, root_file, users_file)
    root_file.chmod(0o600)
    with open(root_file, "ab") as f:
        f.write(b"SECRET\n")
    res = assert_ok(daemon.ctl("restore", ck["id"]), "restore")
    procs.add(res["pid"])
    os.kill(res["pid"], signal.SIGKILL)
    kept = {Path(k).name.split(".ckptd-")[0]: Path(k) for k in res["files_kept"]}
    assert sorted(kept) == ["root.log", "users.log"]
    for name, owner in (("root.log", 0), ("users.log", attacker)):
        st = kept[name].stat()
        assert (st.st_uid, st.st_mode & 0o7777) == (owner, 0o600), name
    assert kept["root.log"].read_bytes().endswith(b"SECRET\n")
    probe = subprocess.run([USER_PYTHON, "-c", "import sys; open(sys.argv[1]).read()",
                            str(kept["root.log"])], user=attacker, group=attacker,
                           extra_groups=[], capture_output=True, check=False)
    assert probe.returncode != 0 and b"PermissionError" in probe.stderr
    assert not list(work.glob("*.part")) and not list(work.glob("*.new"))


def test_a_daemon_killed_during_the_put_back_leaves_every_file_as_found(
    tmp_path: Path, procs: Procs, area: Path
) -> None:
    """SIGKILL at random points of a restore that puts back a 48 MiB file: the next daemon
    finishes the undo from the journal (the file as found, its aside gone, no temporary
    left) or the restore had finished (the file as checkpointed, a complete aside)."""
    if criu_path() is None:
        pytest.skip("no CRIU")
    ds = Daemons(tmp_path)
    big = area / "big.bin"
    big.write_bytes(os.urandom(48 << 20))
    log = area / "job.log"
    try:
        d = ds.start()
        ck = checkpoint_then_crash(d, procs, log, held=big)
        at_ck = big.read_bytes()
        outcomes: set[str] = set()
        for delay in (0.05, 0.2, 0.4, 0.8):
            with open(big, "r+b") as f:  # the version found: differs from the checkpoint's
                f.write(b"X" * 4096)
            found, found_log = big.read_bytes(), log.read_bytes()
            restore = d.popen("restore", ck["id"])
            time.sleep(delay)
            ds.kill9(d)
            restore.wait(timeout=30)
            d = ds.start()  # recovers what the killed daemon left
            asides = sorted(area.glob("big.bin.ckptd-*"))
            assert not [a for a in asides if a.name.endswith((".part", ".new"))], asides
            if big.read_bytes() == found and log.read_bytes() == found_log:
                assert asides == [], "an aside left behind an undone put-back"
                outcomes.add("undone")
            else:  # it had finished: checkpointed content, the version found kept whole
                recovered = [ln for ln in d.log().splitlines() if "interrupted" in ln]
                assert big.read_bytes() == at_ck, f"after {delay}s: {recovered}"
                assert [a.read_bytes() for a in asides] == [found]
                outcomes.add("finished")
                _kill_restored(log)
                for a in asides:
                    a.unlink()
        assert "undone" in outcomes, outcomes
    finally:
        ds.close()


def _kill_restored(path: Path) -> None:
    """The restored job (it writes ``path``): killed, found through /proc, and gone."""
    def writers() -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if any(os.readlink(fd) == str(path) for fd in (entry / "fd").iterdir()):
                    found.append(int(entry.name))
            except OSError:
                continue
        return found

    for pid in writers():
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not writers(), 10, "the restored job gone")


def test_restore_output_keeps_what_the_file_held_and_refuses_magic_links(
    daemon: Daemon, procs: Procs, tmp_path: Path
) -> None:
    job = procs.popen([sys.executable, "-c", WRITER, "40", str(tmp_path / "j.log")],
                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                      stderr=subprocess.DEVNULL, start_new_session=True)
    wait_until(lambda: lines(tmp_path / "j.log") >= 2, 30, "the job's first steps")
    ck = assert_ok(daemon.ctl("dump", job.pid), "dump")
    job.wait(timeout=10)
    res = daemon.ctl("restore", ck["id"], "--output", "/proc/self/fd/1")
    assert_one_line_error(res, res.rc, "/proc/self/fd/1", "magic link")
    out = tmp_path / "existing.out"
    out.write_bytes(b"what the file held before\n")
    res2 = assert_ok(daemon.ctl("restore", ck["id"], "--output", out), "restore --output")
    procs.add(res2["pid"])
    wait_until(lambda: lines(out) >= 4, 30, "the restored job's output")
    os.kill(res2["pid"], signal.SIGKILL)
    assert out.read_bytes().startswith(b"what the file held before\nstep ")
    wait_until(lambda: not Path(f"/proc/{res2['pid']}").exists(), 10, "the job reaped")
    res3 = assert_ok(daemon.ctl("restore", ck["id"]), "restore to the daemon's output file")
    procs.add(res3["pid"])
    os.kill(res3["pid"], signal.SIGKILL)
    assert Path(res3["output_path"]).stat().st_mode & 0o777 == 0o600


def test_roots_asides_remove_leaves_files_only_named_like_asides(
    daemon: Daemon, procs: Procs, area: Path, attacker: int
) -> None:
    """Issue 33 (6): in a sticky shared directory a root job's files are put back and the
    versions found kept aside. The attacker plants a file named like an aside of the job's
    file, and puts another at the name of a recorded copy once that one is gone. Root's
    ``ckptctl asides --remove`` removes only the copies the restore recorded, by identity:
    both planted files stay, the second refused in one line; a name holding a newline is
    printed quoted."""
    shared = area / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    log = shared / "job.log"
    odd = shared / "odd\nname.log"
    other = shared / "other.log"
    ck = checkpoint_then_crash(daemon, procs, log, odd, other)
    res = assert_ok(daemon.ctl("restore", ck["id"]), "restore")
    procs.add(res["pid"])
    os.kill(res["pid"], signal.SIGKILL)
    kept = {Path(k).name.split(".ckptd-")[0]: Path(k) for k in res["files_kept"]}
    assert sorted(kept) == ["job.log", "odd\nname.log", "other.log"], kept

    planted = shared / "job.log.ckptd-planted"
    as_user(attacker, "import sys; open(sys.argv[1], 'w').write('mine\\n')", planted)
    kept["other.log"].unlink()  # the recorded copy gone (its owner removed it) ...
    as_user(attacker, "import sys; open(sys.argv[1], 'w').write('mine too\\n')",
            kept["other.log"])  # ... and the attacker's file at its name

    shown = subprocess.run([str(CKPTCTL), "--socket", str(daemon.socket), "asides", ck["id"]],
                           capture_output=True, text=True, timeout=60, check=False)
    assert shown.returncode == 0, shown
    assert repr(str(kept["odd\nname.log"])) in shown.stdout, shown.stdout
    assert str(kept["odd\nname.log"]) not in shown.stdout, shown.stdout  # never raw
    assert str(planted) not in shown.stdout, shown.stdout

    removed = daemon.ctl("asides", ck["id"], "--remove")
    assert removed.rc == 1, removed
    assert sorted(removed.out["removed"]) == sorted(
        str(kept[n]) for n in ("job.log", "odd\nname.log")), removed.out
    (refused,) = removed.out["problems"]
    assert refused == (f"{kept['other.log']}: another file than the copy restore "
                       f"{kept['other.log'].name.split('.ckptd-')[1]} kept has its name now: "
                       "left alone"), refused
    assert planted.read_bytes() == b"mine\n" and planted.stat().st_uid == attacker
    assert kept["other.log"].read_bytes() == b"mine too\n"
    assert not kept["job.log"].exists() and not kept["odd\nname.log"].exists()

    human = subprocess.run([str(CKPTCTL), "--socket", str(daemon.socket), "asides", ck["id"],
                            "--remove"], capture_output=True, text=True, timeout=60, check=False)
    assert human.returncode == 1, human
    assert human.stderr == f"not removed: {refused}\n", human.stderr
    assert kept["other.log"].read_bytes() == b"mine too\n" and planted.exists()
