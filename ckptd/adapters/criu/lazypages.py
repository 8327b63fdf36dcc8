"""A lazy restore: the tree runs before its memory is back, each page served by ckptd.

CRIU's own post-copy machinery (``criu/uffd.c``, ``criu/page-xfer.c``), with ckptd where CRIU
puts a remote page server:

- ``stage`` (``lazyimages``): every image but the pages is written to the images directory;
  each pages image is a sparse file holding only the pages ``criu restore --lazy-pages``
  reads itself. The others stay in the store until asked for.
- ``LazyDaemon``: ``criu lazy-pages --page-server --ps-socket FD`` started first, on one end
  of a socketpair; the restore hands it each task's userfaultfd. It asks for a missing page
  when a task first touches it, and for all the rest in the background once the restore is
  done, then says ``PS_IOV_CLOSE`` and exits.
- ``PageServing``: the other end, answering each ``PS_IOV_GET <dst_id, vaddr, nr_pages>``
  (``dst_id``: the task's pagemap id) with ``PS_IOV_ADD_F`` and the pages, read from the
  ``ImageSource`` (verified before a byte is sent).

Invariants: no unverified byte is ever sent. A request that cannot be answered (a damaged or
missing page, a request outside the images) is not answered: the task that touched the page
waits for it, and ``LazyPages.failed`` kills the tree *before* the lazy daemon is stopped (a
userfaultfd released with a task waiting on it would let the task go on with a zero page).
The lazy daemon also holds a duplicate of ckptd's end of the socket, so a daemon that dies
(SIGKILL) never shows it an end of file: the tree then waits on its next missing page, and the
restore's journal entry, still open, has the next start kill it. Ended by the lazy daemon
before ``PS_IOV_CLOSE`` (it failed, or was killed): the same failure; and since ckptd holds
copies of the daemon's userfaultfds from post-restore on (``UffdCopies``), its death releases
none of them: a task waiting on a page goes on waiting until the tree is killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import platform
import select
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ckptd.adapters.criu.lazyimages import Pagemap
from ckptd.adapters.criu.pageserver import (
    PAGE_SIZE,
    PE_PRESENT,
    PS_IOV_ADD_F,
    PS_IOV_CLOSE,
    PS_IOV_FORCE_CLOSE,
    PS_IOV_GET,
    Wire,
)
from ckptd.core.ports import ImageSource
from ckptd.errors import CkptdError, CorruptCheckpoint, CriuFailed

log = logging.getLogger(__name__)


READY_WAIT_S = 10.0
"""How long ``criu lazy-pages`` may take to be ready for the restore."""
RECV_SIZE = 1 << 16
LOG_NAME = "lazy-pages.log"
"""The lazy-pages daemon's log, errors only: from warnings up it writes lines per request
(tens of megabytes for a few GiB)."""


class PageServing:
    """Answers the lazy daemon's requests on ``sock`` from ``images`` (one thread).
    ``run`` returns the pages served once the daemon has said ``PS_IOV_CLOSE``; raises
    CkptdError when a request cannot be answered (it is then left unanswered) or the
    daemon hung up first."""

    def __init__(self, sock: socket.socket, images: ImageSource, maps: dict[int, Pagemap],
                 wire: Wire) -> None:
        self._sock = sock
        self._images = images
        self._maps = maps
        self._iov = wire.iov
        self.pages = 0
        self.requests = 0
        self.checkpoint_id = images.checkpoint_id
        self._inbox = bytearray()
        self.busy = 0.0

    def run(self) -> int:
        try:
            return self._serve()
        except (ConnectionResetError, BrokenPipeError):  # died with our answer unread
            raise self._hung_up() from None

    def _hung_up(self) -> CriuFailed:
        return CriuFailed(
            f"CRIU's lazy-pages daemon hung up after {self.pages} pages of "
            f"{self._images.checkpoint_id}, before every page was served",
            hint="its log is lazy-pages.log in the restore's work directory")

    def _serve(self) -> int:
        while True:
            head = self._recv(self._iov.size)
            if head is None:
                raise self._hung_up()
            cmd, nr_pages, vaddr, dst_id = self._iov.unpack(head)
            command = cmd & 0xFFFF
            if command in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
                self._sock.sendall(struct.pack("<i", 0))
                return self.pages
            if command != PS_IOV_GET:
                raise CriuFailed(f"CRIU's lazy-pages daemon sent command {cmd:#x}, not a "
                                 "page request", hint="")
            _t = time.perf_counter()
            self._answer(dst_id, vaddr, nr_pages)
            self.busy += time.perf_counter() - _t

    def _answer(self, dst_id: int, vaddr: int, nr_pages: int) -> None:
        pagemap = self._maps.get(dst_id)
        entry = pagemap.locate(vaddr) if pagemap is not None and nr_pages else None
        if pagemap is None or entry is None:
            raise CorruptCheckpoint(
                f"checkpoint {self._images.checkpoint_id}: the restored task {dst_id} asked "
                f"for {nr_pages} page(s) at {vaddr:#x}, which its images do not hold",
                checkpoint_id=self._images.checkpoint_id)
        count = min(nr_pages, (entry.end - vaddr) // PAGE_SIZE)
        first = entry.first + (vaddr - entry.vaddr) // PAGE_SIZE
        data = self._images.pages(pagemap.pages_name, first, count)  # verified, or raises
        reply = self._iov.pack(PE_PRESENT << 16 | PS_IOV_ADD_F, count, vaddr, dst_id)
        self._send(memoryview(reply), memoryview(data))
        self.pages += count
        self.requests += 1

    def _send(self, head: memoryview, data: memoryview) -> None:
        """``head`` then ``data``, without joining them."""
        parts = [head, data]
        while parts:
            sent = self._sock.sendmsg(parts)
            while parts and sent >= len(parts[0]):
                sent -= len(parts[0])
                parts.pop(0)
            if parts and sent:
                parts[0] = parts[0][sent:]

    def _recv(self, size: int) -> bytes | None:
        """The next ``size`` bytes (requests are read many at a time); None at the end."""
        while len(self._inbox) < size:
            part = self._sock.recv(RECV_SIZE)
            if not part:
                return None
            self._inbox += part
        head = bytes(self._inbox[:size])
        del self._inbox[:size]
        return head


class LazyDaemon:
    """``criu lazy-pages`` for one restore, started before it (``start``: returns once the
    daemon listens for the restore), with its page-server socket's other end ours."""

    def __init__(self, criu_path: str, images_dir: Path, work_dir: Path,
                 env: dict[str, str], log_level: int) -> None:
        self._argv_base = [criu_path, "lazy-pages", "-D", str(images_dir), "-W", str(work_dir),
                           "--page-server", "-o", LOG_NAME, f"-v{min(log_level, 1)}"]
        self._env = env
        self.work_dir = work_dir
        self.sock: socket.socket | None = None
        self._keeper = -1
        self.proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def start(self, placed: Callable[[int], None]) -> None:
        """Started, placed (``placed(pid)``: the restore's cgroup, where the tree will be),
        and ready for the restore to connect. CriuFailed if it does not get ready."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        status_r, status_w = os.pipe()
        self._keeper = os.dup(ours.fileno())  # the daemon's copy of our end: see module doc
        os.set_inheritable(self._keeper, True)
        argv = [*self._argv_base, "--ps-socket", str(theirs.fileno()),
                "--status-fd", str(status_w)]
        try:
            with open(self.work_dir / "lazy-pages.stderr", "wb") as stderr:
                self.proc = subprocess.Popen(
                    argv, pass_fds=(theirs.fileno(), status_w, self._keeper),
                    stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr,
                    start_new_session=True, env=self._env)
        except OSError as exc:
            for fd in (status_r, status_w):
                os.close(fd)
            ours.close()
            raise CriuFailed(f"cannot start CRIU's lazy-pages daemon: {exc}", hint="") from exc
        finally:
            theirs.close()
            os.close(self._keeper)
            self._keeper = -1
        os.close(status_w)
        self.sock = ours
        try:
            placed(self.proc.pid)
            ready = _read_with_timeout(status_r, READY_WAIT_S)
        finally:
            os.close(status_r)
        if not ready:
            self.kill()
            raise CriuFailed("CRIU's lazy-pages daemon did not get ready",
                             log_path=str(self.work_dir / LOG_NAME), hint="")

    def kill(self) -> None:
        """Stop the daemon (SIGKILL) and close our end. Only once nothing waits on a page
        it would release (see the module doc). Idempotent."""
        with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
            if self.proc is not None:
                self.proc.wait()
            if self.sock is not None:
                self.sock.close()
                self.sock = None

    def wait_exit(self, timeout: float) -> int | None:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


def _read_with_timeout(fd: int, timeout: float) -> bool:
    """Whether ``fd`` gave a byte before ``timeout`` (the daemon's ``--status-fd``)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([fd], [], [], left)
        if readable:
            return os.read(fd, 1) != b""
    return False


USERFAULTFD = "anon_inode:[userfaultfd]"
ACCEPTCON = 0x00010000
"""``/proc/net/unix``'s flag of a listening socket (``__SO_ACCEPTCON``)."""
SYS_PIDFD_GETFD = 438
TAKE_WAIT_S = 5.0
RELEASE_POLL_S = 0.005
"""How often the daemon's userfaultfds are compared with our copies (``UffdCopies``): a task
whose pages are all in waits at most this long on its next userfaultfd event."""


class UffdCopies:
    """Our copies (``pidfd_getfd``) of the userfaultfds CRIU's lazy-pages daemon holds, taken
    at post-restore, before any restored task runs: if the daemon dies, the kernel releases
    nothing while we hold them, so a task touching a missing page waits (until killed) instead
    of reading zeros.

    Invariant: a copy is held only while the daemon holds the same userfaultfd. CRIU closes a
    task's userfaultfd once every page of that task is in (or it exited), while it goes on
    serving the others; from then on that task's faults and events (madvise, munmap, mremap,
    fork) must reach no one — the kernel then unregisters its memory and lets it run. A copy
    held past that keeps the userfaultfd alive with no reader, and the task waits forever on
    its next event. So ``release_closed`` (called every few ms while pages are served) closes
    each copy whose file the daemon no longer holds, unless the daemon is exiting (a crash
    closes them all, and then every copy is kept). All copies are closed once every page is
    served, or once the tree is dead. Thread-safe."""

    def __init__(self) -> None:
        self.fds: list[int] = []
        self._theirs: dict[int, int] = {}  # our copy -> the daemon's fd of the same file
        self._pid = 0
        self._lock = threading.Lock()

    def take(self, pid: int) -> int:
        """Copy every userfaultfd of ``pid`` once it has received all of them (its listening
        socket is closed: CRIU's ``prepare_uffds`` done). Returns how many; CriuFailed if it
        does not get there in TAKE_WAIT_S."""
        deadline = time.monotonic() + TAKE_WAIT_S
        while True:
            targets = _fd_targets(pid)
            sockets = {int(t[8:-1]) for t in targets.values() if t.startswith("socket:[")}
            if not sockets & _listening_unix_inodes():
                break
            if time.monotonic() > deadline:
                raise CriuFailed("CRIU's lazy-pages daemon did not take the restored tasks' "
                                 f"userfaultfds in {TAKE_WAIT_S:g}s", hint="")
            time.sleep(0.002)
        pidfd = os.pidfd_open(pid)
        try:
            with self._lock:
                self._pid = pid
                for fd, target in targets.items():
                    if target == USERFAULTFD:
                        copy = _pidfd_getfd(pidfd, fd)
                        self.fds.append(copy)
                        self._theirs[copy] = fd
        finally:
            os.close(pidfd)
        return len(self.fds)

    def release_closed(self) -> int:
        """Close each copy whose userfaultfd the (living, not exiting) daemon has closed;
        returns how many were closed."""
        with self._lock:
            if not self._theirs:
                return 0
            closed = [ours for ours, theirs in self._theirs.items()
                      if not _same_file(self._pid, ours, theirs)]
            if not closed or _exiting(self._pid):
                return 0
            for ours in closed:
                del self._theirs[ours]
                self.fds.remove(ours)
                os.close(ours)
            return len(closed)

    def close(self) -> None:
        with self._lock:
            for fd in self.fds:
                os.close(fd)
            self.fds = []
            self._theirs.clear()


SYS_KCMP = {"x86_64": 312, "aarch64": 272}.get(platform.machine(), 0)
"""kcmp(2)'s number here (0: unknown, then no copy is released before the end)."""
KCMP_FILE = 0
PF_EXITING = 0x4
_LIBC = ctypes.CDLL(None, use_errno=True)


def _same_file(pid: int, ours: int, theirs: int) -> bool:
    """Whether fd ``theirs`` of ``pid`` is the very file our fd ``ours`` is (kcmp): False
    once the daemon closed it, or reused the number for another file."""
    if not SYS_KCMP:
        return True
    result = int(_LIBC.syscall(ctypes.c_long(SYS_KCMP), ctypes.c_int(os.getpid()),
                              ctypes.c_int(pid), ctypes.c_int(KCMP_FILE),
                              ctypes.c_ulong(ours), ctypes.c_ulong(theirs)))
    if result < 0 and ctypes.get_errno() != errno.EBADF:  # EBADF: the daemon closed it
        return True  # cannot tell (EPERM, ESRCH: exiting): keep the copy
    return result == 0


def _exiting(pid: int) -> bool:
    """Whether ``pid`` is gone or exiting (PF_EXITING, set before an exiting task's files
    are closed): its fds then vanish because it dies, not because a task's pages are in."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    after_comm = stat.rsplit(")", 1)[1].split()
    return after_comm[0] in ("Z", "X") or bool(int(after_comm[6]) & PF_EXITING)


def _fd_targets(pid: int) -> dict[int, str]:
    found: dict[int, str] = {}
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError as exc:
        raise CriuFailed(f"CRIU's lazy-pages daemon (pid {pid}) is gone: {exc}",
                         hint="its log is lazy-pages.log in the restore's work directory"
                         ) from exc
    for name in names:
        with contextlib.suppress(OSError):
            found[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
    return found


def _listening_unix_inodes() -> set[int]:
    inodes: set[int] = set()
    with open("/proc/net/unix") as table:
        next(table)
        for line in table:
            fields = line.split()
            if len(fields) >= 7 and int(fields[3], 16) & ACCEPTCON:
                inodes.add(int(fields[6]))
    return inodes


def _pidfd_getfd(pidfd: int, fd: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    copy = int(libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0))
    if copy < 0:
        err = ctypes.get_errno()
        raise CriuFailed(f"cannot copy fd {fd} of CRIU's lazy-pages daemon: "
                         f"{os.strerror(err)}", hint="")
    return copy


class LazyRun:
    """Serves one lazy restore's pages in a thread from ``begin`` (the tree runs) to the end
    and tells ``on_end(error, pages, seconds)``; the failure path is the module doc's."""

    def __init__(self, daemon: LazyDaemon, serving: PageServing,
                 failed: Callable[[CkptdError], None],
                 done: Callable[[int, float], None], copies: UffdCopies) -> None:
        self._daemon = daemon
        self._serving = serving
        self._copies = copies
        self._failed = failed
        self._done = done
        self._thread = threading.Thread(target=self._main, name="lazy pages", daemon=True)
        self._releaser = threading.Thread(target=self._release_loop, name="lazy uffds",
                                          daemon=True)
        self._serving_ended = threading.Event()
        self._begun = 0.0

    def begin(self) -> None:
        self._begun = time.monotonic()
        self._thread.start()
        self._releaser.start()

    def _release_loop(self) -> None:
        """Let go of each task's userfaultfd as soon as CRIU has (``UffdCopies``)."""
        while not self._serving_ended.wait(RELEASE_POLL_S):
            try:
                self._copies.release_closed()
            except Exception:  # keep them (never let a task read zeros); try again
                log.exception("lazy restore: checking CRIU's userfaultfds failed")

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _main(self) -> None:
        try:
            self._serve()
        finally:
            self._serving_ended.set()

    def _serve(self) -> None:
        try:
            pages = self._serving.run()
        except Exception as exc:
            error = exc if isinstance(exc, CkptdError) else CriuFailed(
                f"serving a lazy restore's pages failed: {exc}", hint="")
            log.error("lazy restore: %s", error)
            try:
                self._failed(error)  # kills the tree; only then is the daemon let go
            finally:
                self._daemon.kill()
                self._copies.close()
            return
        code = self._daemon.wait_exit(10.0)
        self._daemon.kill()
        self._copies.close()  # (held on, they would hold the tree's next fork event)
        if code not in (0, None):
            log.warning("CRIU's lazy-pages daemon exited %s after serving every page", code)
        seconds = time.monotonic() - self._begun
        log.info("lazy restore of %s: %d pages served in %d requests, %.2fs (%.2fs of it "
                 "reading and sending them)", self._serving.checkpoint_id, pages,
                 self._serving.requests, seconds, self._serving.busy)
        self._done(pages, seconds)
