"""``ckptctl run [--name N] [--every D] [--keep K] [--grace S] -- COMMAND ...``

Launches COMMAND under the daemon's protection, with no change to it: in a session of its own
(CRIU needs that), with this terminal's stdio, registered as a protected job (and periodic
checkpoints with ``--every``). Then it waits:

- COMMAND exits on its own: its policy is cleared, and ``run`` exits with its status;
- COMMAND is killed by a signal (SIGKILL, the OOM killer, a crash) after a checkpoint of its
  policy: the policy is kept, ``run`` says which checkpoint is the newest and that ``ckptctl
  resume NAME`` restores it, and exits with the job's status (137 for SIGKILL);
- ``run`` gets SIGTERM (Kubernetes, Slurm, systemd stopping it): the daemon checkpoints and
  stops the job (a drain of that one job), within ``--grace`` seconds; ``run`` says where the
  checkpoint is (``ckptctl resume NAME`` restores it) and exits 143, so that schedulers see
  an interrupted job, not a finished one. If the checkpoint fails, the job gets the SIGTERM
  itself and ``run`` exits with its status;
- any other signal ``run`` gets (SIGINT, SIGHUP, SIGQUIT, SIGUSR1/2, SIGWINCH, SIGCONT) is
  passed to the job.

As a container's entrypoint (pid 1 of its pid namespace: the next pod of a Kubernetes Job),
``run`` first looks for a checkpoint of ``--name``: when there is one, the daemon restores
its newest INTO this container (docs/adr/0011): the job comes back as ``run``'s child, in the
container's namespaces, cgroups and root file system, writing to the container's stdout, and
``run`` then waits for it as above (reaping every other orphan, as an init must). A restore
that fails or is refused starts nothing: ``run`` says why in one line and exits 1
(``--fresh-on-failure`` starts COMMAND instead; ``--fresh`` never restores). Without a
checkpoint, COMMAND starts as usual. Outside containers ``run`` always starts COMMAND (a
restored tree could not become its child): ``ckptctl restore --name`` restores there.

The job never gets an io_uring instance, which CRIU cannot checkpoint: a seccomp filter makes
``io_uring_setup`` fail with ENOSYS in it and all its descendants, and libraries (libuv under
PyTorch's TCPStore) fall back to epoll (``no_io_uring``; ``--allow-io-uring`` opts out).
"""

from __future__ import annotations

import argparse
import os
import signal
import stat
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from ckptd.transport.cli import args as types
from ckptd.transport.cli import lazy
from ckptd.transport.cli.jobs import Command
from ckptd.transport.cli.output import (
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    PROG,
    CliError,
    err,
    one_line,
    stream_result,
)

if TYPE_CHECKING:  # imported on first use (lazy.py): building the parser needs none
    import shutil
    import subprocess

    from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb
    from ckptd.transport.cli import no_io_uring, wire
else:
    shutil = lazy.module("shutil")
    subprocess = lazy.module("subprocess")
    wire = lazy.module("ckptd.transport.cli.wire")
    pb = lazy.module("ckptd._gen.ckptd.v1.ckptd_pb2")
    no_io_uring = lazy.module("ckptd.transport.cli.no_io_uring")

EXIT_TERMINATED = 143
PASSED_ON = (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGWINCH, signal.SIGCONT)


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


def cmd_run(ctx: Any, args: argparse.Namespace) -> int:
    command = list(args.argv)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CliError("give the command to run after --, e.g. ckptctl run -- python train.py",
                       EXIT_USAGE)
    name = args.name or f"{os.path.basename(command[0])}-{os.getpid()}"
    if args.allow_io_uring:
        err("--allow-io-uring: the job may use io_uring, and then cannot be checkpointed")
        argv = command
    else:
        argv = no_io_uring.launcher(command)  # the filter, then exec: the job's own pid
        if argv is not command and shutil.which(command[0]) is None:
            raise CliError(f"cannot start {command[0]}: No such file or directory", 127)
    terminated = threading.Event()
    handlers = {signal.SIGTERM: signal.signal(signal.SIGTERM, lambda *_: terminated.set())}
    job = _restore_into_this_container(ctx, args, name) if _container_init() else None
    if job is None:
        _reserve_pids(ctx)
        try:
            started = subprocess.Popen(argv, start_new_session=True)
            job = Child(started.pid, started)
        except OSError as exc:
            signal.signal(signal.SIGTERM, handlers[signal.SIGTERM])
            raise CliError(f"cannot start {command[0]}: {exc.strerror}", 127) from exc
    for signo in PASSED_ON:
        handlers[signo] = signal.signal(signo, lambda s, _f: _pass_on(job, s))
    try:
        policy = pb.Policy(name=name, every_s=args.every or 0.0, keep=args.keep or 0,
                           on_term=True, files_dirs=args.files or [])
        try:
            # the daemon finds the job as our only child: our pids may not be its pids
            ctx.client.SetPolicy(pb.SetPolicyRequest(policy=policy, callers_child=True),
                                 timeout=ctx.timeout)
        except wire.RpcError:
            _signal_job(job, signal.SIGTERM)
            job.wait()
            raise
        while job.poll() is None and not terminated.wait(0.2):
            pass
        # A SIGTERM that finds the job ended (it finished just before: a time limit's signal
        # comes up to a minute late) has nothing to checkpoint: the job's own status stands,
        # never 143, so a batch script does not requeue a finished job.
        if terminated.is_set() and job.poll() is None:
            return _checkpoint_then_stop(ctx, args, job, name)
        code = job.wait() if job.poll() is not None else None
        died = code is not None and code < 0 and not terminated.is_set()
        drained, kept = _forget_ended(ctx, name, died=died)
        if drained:  # a drain, a spot notice or `ckptctl dump --name` (preStop) took it
            notice(f"{name} (pid {job.pid}) was checkpointed as {drained} and stopped; "
                   f"{_restores_it(name)}")
            return EXIT_TERMINATED
        if died and code is not None:
            how = f"{name} (pid {job.pid}) was killed by {_signal_name(-code)}"
            if kept:
                notice(f"{how}; its newest checkpoint is {kept}: {_restores_it(name)}")
            else:
                notice(f"{how} before any checkpoint of it: nothing to resume")
            return _status(code)
        if terminated.is_set():
            err(f"{name} (pid {job.pid}) had ended (exit status {_status(job.wait())}) "
                "before SIGTERM: nothing to checkpoint")
        return _status(job.wait())
    finally:
        for signo, old in handlers.items():
            signal.signal(signo, old)


def notice(text: str) -> None:
    """``text`` where the user of ``run`` sees it. Not into a regular file: ``run``'s stderr
    redirected to a file is the job's stderr file too, which a restore puts back to its
    content at the checkpoint — the line would survive only in the copy kept aside. So: the
    first of stderr, stdout that is not a regular file, else the controlling terminal, else
    stderr all the same (nothing better exists)."""
    line = f"{PROG}: {one_line(text)}\n".encode()
    sys.stderr.flush()
    for fd in (2, 1):
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.write(fd, line)
                return
        except OSError:
            continue
    try:
        tty = os.open("/dev/tty", os.O_WRONLY | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        err(text)
        return
    try:
        os.write(tty, line)
    finally:
        os.close(tty)


RESERVED_PIDS = 1000
"""In a container, the job's pids start above this: the next container's own processes (its
init, ``ckptctl run``'s threads) take low pids, and a restore there needs the job's free."""


def _reserve_pids(ctx: Any) -> None:
    """Ask the daemon to move our pid namespace's counter (a no-op outside a container); a
    daemon without it, or a failure, only costs the job's restorability into another
    container: said in one line, the job starts anyway."""
    try:
        ctx.client.ReservePids(pb.ReservePidsRequest(above=RESERVED_PIDS), timeout=ctx.timeout)
    except wire.RpcError as exc:
        if exc.code() is not wire.StatusCode.UNIMPLEMENTED:
            err(f"cannot reserve pids for the job ({exc.details()}); it may not be restorable "
                "into another container")


class Child:
    """The job: a child of ours, started or adopted (a restored tree's root, reparented to
    us). As the init of a container, waiting for it also reaps every other process that
    ends orphaned there; ``returncode`` as ``subprocess`` says it (-N: killed by signal N)."""

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None = None) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._reap_all = os.getpid() == 1
        self._popen = popen  # kept, and told the status: it must never reap the pid itself

    def poll(self) -> int | None:
        if self.returncode is None:
            self._reap(block=False)
        return self.returncode

    def wait(self) -> int:
        while self.returncode is None:
            self._reap(block=True)
        return self.returncode

    def _reap(self, *, block: bool) -> None:
        target = -1 if self._reap_all else self.pid
        while True:
            try:
                pid, status = os.waitpid(target, 0 if block else os.WNOHANG)
            except ChildProcessError:  # not our child (any more): gone without a status
                self.returncode = 255 if self.returncode is None else self.returncode
                return
            if pid == 0:
                return
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                if self._popen is not None:
                    self._popen.returncode = self.returncode
                return


def _restores_it(name: str) -> str:
    """How the job comes back: in a container, the next ``ckptctl run --name`` there."""
    if _container_init():
        return (f"the next container started with `ckptctl run --name {name}` restores it "
                "into itself")
    return f"`ckptctl resume {name}` restores it"


def _container_init() -> bool:
    """We are pid 1 of our pid namespace: a container's entrypoint."""
    return os.getpid() == 1


EXIT_RESTORE_FAILED = 1


def _restore_into_this_container(
    ctx: Any, args: argparse.Namespace, name: str
) -> Child | None:
    """The newest checkpoint of ``name`` restored into this container, as our child; None
    when there is none (or ``--fresh``), or when it fails and ``--fresh-on-failure`` says
    to start afresh. Raises CliError (exit 1) when it fails otherwise."""
    if args.fresh or not args.name:
        return None
    try:
        listed = ctx.client.List(pb.ListRequest(name=name), timeout=ctx.timeout)
    except wire.RpcError as exc:
        raise CliError(f"cannot look for a checkpoint of {name}: {exc.details()}",
                       EXIT_UNAVAILABLE) from exc
    if not listed.checkpoints:
        return None
    newest = max(listed.checkpoints, key=lambda c: (c.created, c.id))
    try:
        result = stream_result(ctx.client.Restore(
            pb.RestoreRequest(checkpoint_id=newest.id, into_callers_container=True),
            timeout=ctx.timeout), "result")
        if result is None:
            raise CliError(f"ckptd ended the restore of {newest.id} without a result")
    except (wire.RpcError, CliError) as exc:
        why = exc.details() if isinstance(exc, wire.RpcError) else str(exc)
        if args.fresh_on_failure:
            err(f"cannot restore {name} from {newest.id}: {why}; starting it afresh "
                "(--fresh-on-failure)")
            return None
        raise CliError(f"cannot restore {name} from {newest.id}: {why} (nothing was "
                       "started; --fresh-on-failure starts the command afresh instead)",
                       EXIT_RESTORE_FAILED) from exc
    err(f"{name} restored from {newest.id} as pid {result.ns_pid} "
        f"({result.duration_s:.2f}s)")
    return Child(int(result.ns_pid))


def _pass_on(job: Child, signo: int) -> None:
    _signal_job(job, signo)


def _signal_job(job: Child, signo: int) -> None:
    """Signal the job we started through a pidfd: never a process that took its pid after it
    ended (it is our child, so its pid stays its own until we reap it; the pidfd keeps that
    true whoever reaps it)."""
    if job.poll() is not None:
        return
    try:
        fd = os.pidfd_open(job.pid)
    except OSError:
        return  # already reaped
    try:
        if job.returncode is None:
            signal.pidfd_send_signal(fd, signo)
    except ProcessLookupError:
        pass
    finally:
        os.close(fd)


def _signal_name(signo: int) -> str:
    try:
        return signal.Signals(signo).name
    except ValueError:
        return f"signal {signo}"


def _forget_unless_drained(ctx: Any, name: str, wait_s: float = 60.0) -> str:
    """The job ended: its drain checkpoint id if a drain stopped it, else clear its policy
    and return ""."""
    return _forget_ended(ctx, name, died=False, wait_s=wait_s)[0]


def _forget_ended(ctx: Any, name: str, *, died: bool, wait_s: float = 60.0
                  ) -> tuple[str, str]:
    """The job ended: (its drain checkpoint id, "") if a drain stopped it; ("", the newest
    checkpoint of its policy) when it ``died`` (killed by a signal) after one, its policy
    kept for ``ckptctl resume``; else its policy cleared, ("", ""). While the daemon is
    still checkpointing it (the job dies before the checkpoint is recorded), clearing is
    refused as busy: ask again."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            # one call: a look then a clear would forget a drain that ends between the two
            response = ctx.client.ClearPolicy(
                pb.ClearPolicyRequest(name=name, unless_drained=True,
                                      unless_died_checkpointed=died), timeout=ctx.timeout)
            return str(response.drained_checkpoint_id), str(response.kept_checkpoint_id)
        except wire.RpcError as exc:
            busy = exc.code() == wire.StatusCode.ABORTED
            if not busy or time.monotonic() > deadline:
                return "", ""  # the job is over; a stale policy only names a pid that is gone
            time.sleep(0.2)


def _checkpoint_then_stop(
    ctx: Any, args: argparse.Namespace, job: Child, name: str
) -> int:
    late = False
    try:
        response = ctx.client.Drain(pb.DrainRequest(names=[name]), timeout=args.grace)
    except wire.RpcError as exc:
        if exc.code().name not in _STILL_GOING:
            if job.poll() is None:  # else: refused as the job had ended, said below
                err(f"checkpoint of {name} before termination failed: {exc.details()}; "
                    "stopping it")
            response = None
        else:
            # The daemon may be checkpointing it right now: a SIGTERM sent into the dump would
            # be saved in the image. Ask again, without the budget: a drain waits for one under
            # way, and answers with its checkpoint (or takes it, if the first never arrived).
            late = True
            try:
                response = ctx.client.Drain(pb.DrainRequest(names=[name]), timeout=LATE_S)
            except wire.RpcError as again:
                err(f"checkpoint of {name} before termination failed: {again.details()}; "
                    "stopping it")
                response = None
    if response is not None and response.drained:
        ck = response.drained[0].drained_checkpoint_id
        job.wait()
        after = f" (after --grace {args.grace:g}s)" if late else ""
        notice(f"{name} (pid {job.pid}) checkpointed as {ck} before termination{after}; "
               f"{_restores_it(name)}")
        return EXIT_TERMINATED
    if response is None and job.poll() is not None:
        # refused because the job ended meanwhile (after the check in cmd_run): no failure
        _forget_unless_drained(ctx, name)
        err(f"{name} (pid {job.pid}) ended (exit status {_status(job.wait())}) before it "
            "could be checkpointed: nothing to checkpoint")
        return _status(job.wait())
    if response is not None:
        for line in response.errors:
            err(f"checkpoint of {name} before termination failed: {line}; stopping it")
    _signal_job(job, signal.SIGTERM)
    return _status(job.wait())


_STILL_GOING = frozenset({"DEADLINE_EXCEEDED", "ABORTED", "CANCELLED"})
"""gRPC status names (``wire.StatusCode.X.name``) after which the daemon may still be dumping."""
LATE_S = 900.0
"""How long run waits, past --grace, for a checkpoint the daemon may still be taking."""


def add_command(command: Command) -> None:
    run = command("run", cmd_run,
                  "run a command under ckptd's protection: checkpointed on SIGTERM, drain and "
                  "spot notices (and every --every)")
    run.add_argument("--name", metavar="NAME", type=types.name,
                     help="the job's name (its checkpoints get it; default COMMAND-PID)")
    run.add_argument("--every", metavar="DURATION", type=types.every,
                     help="also take a leave-running checkpoint this often: 15m, 1h")
    run.add_argument("--keep", metavar="N", type=types.keep,
                     help="keep the newest N checkpoints")
    run.add_argument("--files", metavar="DIR", action="append", type=types.files_dir,
                     help=types.FILES_HELP)
    run.add_argument("--grace", metavar="SECONDS", type=types.grace, default=25.0,
                     help="how long the checkpoint on SIGTERM may take (default 25, inside "
                     "Kubernetes' default 30 s grace period)")
    run.add_argument("--allow-io-uring", action="store_true",
                     help="do not keep io_uring away from the job (by default io_uring_setup "
                     "fails with ENOSYS in it, so libraries fall back to epoll); a job that "
                     "then uses io_uring cannot be checkpointed")
    run.add_argument("--fresh", action="store_true",
                     help="as a container's entrypoint, start COMMAND even when a checkpoint "
                     "of --name exists (by default the newest is restored into the container)")
    run.add_argument("--fresh-on-failure", action="store_true",
                     help="when restoring the checkpoint of --name fails, start COMMAND "
                     "afresh instead of exiting 1")
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
