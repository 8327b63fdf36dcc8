"""Policies and protected jobs: periodic checkpoints, retention, drain/resume, spot notices.

A policy names a job (``name``; its checkpoints carry that name) and its root ``pid`` here.
``tick`` (called about every second by the daemon) takes a leave-running checkpoint of each
job whose ``every_s`` has passed; ``drain`` checkpoints and stops every protected job
(``on_term``) at once and remembers each one's checkpoint; ``resume`` restores them; a spot
notice drains. A protected job that died (killed, not drained) keeps its policy when
``ckptctl run`` says so (``clear_ended``), and ``resume`` by name restores the newest checkpoint
its policy took. Every change is saved through the ``PolicyRepo`` before it is answered, so
policies and drained jobs survive a daemon restart.

Invariants: a non-root caller sees and changes only its own uid's policies, and checkpoints run
as the policy's uid (the dump's own permission checks apply); a failed periodic checkpoint is
recorded (``last_error``, an event) and retried at the next period, never raised into the
scheduler; a job whose drain checkpoint failed is left running and reported; ``resume`` never
restores a job whose process still runs (the restored one included: a second resume is
refused), nor two at once (one job, one checkpoint or resume at a time).
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from ckptd.core.callers import caller_process
from ckptd.core.events import EventBus
from ckptd.core.ports import Clock, PolicyRepo, ProcessTable
from ckptd.core.targets import check_process_target
from ckptd.domain import (
    Caller,
    CheckpointRecord,
    DumpRequest,
    Event,
    EventKind,
    PidState,
    Policy,
    RestoreOutcome,
    RestoreRequest,
    valid_name,
)
from ckptd.domain.model import ROOT
from ckptd.errors import (
    Busy,
    CheckpointNotFound,
    CkptdError,
    InvalidTarget,
    PermissionDenied,
    PreconditionFailed,
)

log = logging.getLogger(__name__)

MIN_EVERY_S = 10.0
DRAIN_WAIT_S = 600.0
"""How long a drain waits for a checkpoint of the same job already under way."""
Dump = Callable[[Caller, DumpRequest], CheckpointRecord]
Restore = Callable[[Caller, RestoreRequest], RestoreOutcome]


class PolicyService:
    def __init__(
        self,
        *,
        dump: Dump,
        restore: Restore,
        repo: PolicyRepo,
        processes: ProcessTable,
        clock: Clock,
        events: EventBus,
        drain_workers: int = 8,
        daemon_pid: int = 0,
    ) -> None:
        self._daemon_pid = daemon_pid
        """The daemon's own pid: never a job (0: unknown, only pid 1 is refused)."""
        self._dump = dump
        self._restore = restore
        self._repo = repo
        self._processes = processes
        self._clock = clock
        self._events = events
        self._drain_workers = drain_workers
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._policies: dict[tuple[int, str], Policy] = {
            (p.uid, p.name): p for p in repo.load()}
        """By owner and name: a job name is its owner's (issue 21)."""
        events.add_listener(self._on_event)
        self._busy: set[tuple[int, str]] = set()
        """Jobs being checkpointed by a policy or a drain: their policy cannot be cleared."""

    # ---- policies ---------------------------------------------------------------------------

    def set(self, caller: Caller, policy: Policy, *, callers_child: bool = False) -> Policy:
        """Create or change the policy of ``policy.name`` (its record fields are kept).
        ``callers_child``: the job is the caller's only child process (the caller may live
        in another pid namespace, where its pids mean nothing here)."""
        if callers_child:
            policy = replace(policy, pid=self._only_child(caller))
        if not valid_name(policy.name):
            raise InvalidTarget(
                f"invalid job name {policy.name!r}",
                hint="use letters, digits and . _ : @ + - (at most 128)",
            )
        if policy.every_s and policy.every_s < MIN_EVERY_S:
            raise InvalidTarget(
                f"--every {policy.every_s:g}s is too short", hint=f"use at least {MIN_EVERY_S:g}s"
            )
        if policy.keep < 0:
            raise InvalidTarget("--keep must be positive")
        status = self._processes.status(policy.pid) if policy.pid else None
        if status is not None:
            if status.state is PidState.FREE:
                raise InvalidTarget(f"no process with pid {policy.pid}", pid=policy.pid)
            check_process_target(self._processes, policy.pid, status, self._daemon_pid)
            if not caller.is_root and status.uid != caller.uid:
                raise PermissionDenied(
                    f"pid {policy.pid} belongs to uid {status.uid}, the caller is uid "
                    f"{caller.uid}", pid=policy.pid,
                )
        with self._lock:
            if not caller.is_root:
                old = self._policies.get((caller.uid, policy.name))
            elif status is not None:
                old = self._policies.get((status.uid, policy.name))
            else:
                old = self._find(caller, policy.name)
            if old is not None:
                self._check_owner(caller, old)
                # the same process: a restored job gets its old pid back, but a new start time
                same_job = policy.pid == 0 or (policy.pid == old.pid and (
                    status is None or not old.started or status.start_time == old.started))
                policy = replace(
                    policy, last_fired=old.last_fired, last_error=old.last_error,
                    # what a died job's resume restores: never a checkpoint of the run
                    # before a new `ckptctl run` (its command starts afresh)
                    last_checkpoint_id="" if callers_child and not same_job
                    else old.last_checkpoint_id,
                    # a new process under the name (a restored or restarted job) runs again
                    drained_checkpoint_id=old.drained_checkpoint_id if same_job else "",
                    pid=old.pid if same_job else policy.pid, uid=old.uid,
                    started=old.started if same_job else status.start_time if status else 0,
                )
            else:
                owner = status.uid if caller.is_root and status else caller.uid
                policy = replace(policy, uid=owner,
                                 started=status.start_time if status else 0)
            self._policies[(policy.uid, policy.name)] = policy
            self._save()
        self._events.publish(EventKind.POLICY_SET, pid=policy.pid, name=policy.name,
                             uid=policy.uid,
                             message=describe(policy), every_s=policy.every_s,
                             keep=policy.keep, on_term=policy.on_term)
        return policy

    def list(self, caller: Caller) -> builtins.list[Policy]:
        with self._lock:
            return [p for p in sorted(self._policies.values(), key=lambda p: p.name)
                    if caller.is_root or p.uid == caller.uid]

    def get(self, caller: Caller, name: str) -> Policy:
        """The caller's policy of ``name`` (root: anyone's, refused when owners share it)."""
        with self._lock:
            policy = self._find(caller, name)
        if policy is None:
            raise CheckpointNotFound(f"no policy for job {name!r}",
                                     hint="see them with `ckptctl policy show`")
        self._check_owner(caller, policy)
        return policy

    def clear(self, caller: Caller, name: str, *, unless_drained: bool = False) -> str:
        """Forget the policy ``name``; refused (Busy) while it is being checkpointed. With
        ``unless_drained``, a policy whose job was drained is kept and its checkpoint id
        returned instead (looked at and cleared under one lock: a drain that ends between a
        caller's look and its clear is never forgotten); "" when cleared."""
        policy = self.get(caller, name)
        with self._lock:
            key = (policy.uid, name)
            if key in self._busy:
                raise Busy(f"job {name} is being checkpointed right now",
                           hint="retry when it is done (`ckptctl policy show`)")
            current = self._policies.get(key, policy)
            if unless_drained and current.drained_checkpoint_id:
                return current.drained_checkpoint_id
            self._policies.pop(key, None)
            self._save()
        self._events.publish(EventKind.POLICY_CLEARED, pid=policy.pid, name=name,
                             uid=policy.uid,
                             message=f"policy of {name} cleared")
        return ""

    def clear_ended(self, caller: Caller, name: str, *, died: bool) -> tuple[str, str]:
        """The job of ``name`` ended (``ckptctl run`` saw it): forget its policy, unless it was
        drained, or ``died`` (killed by a signal) after its policy took a checkpoint: then the
        policy is kept, for ``resume``. Returns (drained checkpoint, kept checkpoint), ("", "")
        when cleared; looked at and cleared under one lock, refused (Busy) while the job is
        being checkpointed, as ``clear``."""
        policy = self.get(caller, name)
        with self._lock:
            key = (policy.uid, name)
            if key in self._busy:
                raise Busy(f"job {name} is being checkpointed right now",
                           hint="retry when it is done (`ckptctl policy show`)")
            current = self._policies.get(key, policy)
            if current.drained_checkpoint_id:
                return current.drained_checkpoint_id, ""
            if died and current.last_checkpoint_id and not (current.pid
                                                            and self._alive(current)):
                kept = self._policies.get(key, current).last_checkpoint_id
                self._events.publish(
                    EventKind.POLICY_SET, pid=current.pid, name=name, uid=current.uid,
                    checkpoint_id=kept,
                    message=f"{name} died; its policy is kept: `ckptctl resume {name}` "
                    f"restores {kept}")
                return "", kept
        return self.clear(caller, name, unless_drained=True), ""

    # ---- periodic ---------------------------------------------------------------------------

    def tick(self) -> builtins.list[str]:
        """Take the periodic checkpoints that are due; returns the names fired. A failure is
        recorded on the policy and as an event, never raised."""
        now = self._clock.time()
        with self._lock:
            due = [
                p for p in self._policies.values()
                if p.every_s > 0 and p.pid and not p.drained_checkpoint_id
                and now - p.last_fired >= p.every_s and self._alive(p)
            ]
        for policy in due:
            try:
                self._fire(policy, leave_running=True, kind=EventKind.POLICY_FIRED)
            except CkptdError:
                pass  # recorded by _fire
            except Exception:
                log.exception("policy %s: unexpected failure", policy.name)
        return [p.name for p in due]

    def _fire(self, policy: Policy, *, leave_running: bool, kind: EventKind) -> Policy:
        with self._holding(policy, wait_s=0.0):
            return self._fire_held(policy, leave_running=leave_running, kind=kind)

    @contextlib.contextmanager
    def _holding(self, policy: Policy, wait_s: float,
                 doing: str = "checkpointed") -> Iterator[None]:
        """One checkpoint (or resume) of a job at a time: wait up to ``wait_s`` for the one
        under way (a drain waits for a periodic checkpoint; a periodic one skips a draining
        job)."""
        key = (policy.uid, policy.name)
        with self._idle:
            if not self._idle.wait_for(lambda: key not in self._busy, timeout=wait_s):
                raise Busy(f"job {policy.name} is being {doing} already",
                           hint="retry when that is done (`ckptctl policy show`)")
            self._busy.add(key)
        try:
            yield
        finally:
            with self._idle:
                self._busy.discard(key)
                self._idle.notify_all()

    def _fire_held(self, policy: Policy, *, leave_running: bool, kind: EventKind) -> Policy:
        caller = Caller(uid=policy.uid)
        request = DumpRequest(pid=policy.pid, leave_running=leave_running, name=policy.name,
                              keep=policy.keep, files_dirs=policy.files_dirs)
        try:
            record = self._dump(caller, request)
        except CkptdError as exc:
            self._update(policy, last_fired=self._clock.time(), last_error=str(exc))
            self._events.publish(kind, pid=policy.pid, name=policy.name, uid=policy.uid,
                                 message=f"checkpoint of {policy.name} failed: {exc}",
                                 error=type(exc).__name__)
            log.warning("policy %s: checkpoint of pid %d failed: %s", policy.name, policy.pid,
                        exc)
            raise
        updated = self._update(policy, last_fired=self._clock.time(), last_error="",
                               last_checkpoint_id=record.id)
        self._events.publish(kind, pid=policy.pid, checkpoint_id=record.id, name=policy.name,
                             uid=policy.uid,
                             message=f"checkpoint of {policy.name} taken by policy",
                             leave_running=leave_running, bytes_new=record.bytes_new)
        return updated

    # ---- protected jobs -----------------------------------------------------------------------

    def drain(
        self, caller: Caller, names: Sequence[str] = (), reason: str = "drain"
    ) -> tuple[builtins.list[Policy], builtins.list[str]]:
        """Checkpoint and stop every protected job running here (or the ones ``names``), all
        at once. Returns the drained policies and one line per job left running."""
        if not caller.is_root and not names:
            raise PermissionDenied("only root may drain the node",
                                   hint="name your own job: `ckptctl drain --name N`")
        with self._lock:
            targets = [  # a user's names are its own jobs' only (issue 21)
                p for p in self._policies.values()
                if (p.name in names if names else p.on_term) and p.pid
                and (caller.is_root or p.uid == caller.uid)
                and not p.drained_checkpoint_id and self._alive(p)
            ]
        for p in targets:
            self._check_owner(caller, p)
        missing = [n for n in names if n not in {p.name for p in targets}]
        if names and not targets:  # nothing to do: a bad request, not a failed drain
            raise CheckpointNotFound(
                f"no running protected job named {', '.join(repr(n) for n in missing[:3])}"
                f"{' ...' if len(missing) > 3 else ''} here",
                hint="see them with `ckptctl policy show`")
        errors = [f"{n}: no running protected job of that name here" for n in missing]
        drained: builtins.list[Policy] = []
        if targets:
            with ThreadPoolExecutor(max_workers=self._drain_workers,
                                    thread_name_prefix="drain") as pool:
                results = list(pool.map(self._drain_one, targets))
            for policy, error in results:
                if error:
                    errors.append(error)
                elif policy is not None:
                    drained.append(policy)
        self._events.publish(
            EventKind.DRAIN, message=f"{reason}: {len(drained)} job(s) checkpointed and "
            f"stopped, {len(errors)} failed", drained=len(drained), failed=len(errors),
            reason=reason,
        )
        return drained, errors

    def _drain_one(self, policy: Policy) -> tuple[Policy | None, str]:
        try:
            with self._holding(policy, wait_s=DRAIN_WAIT_S):
                with self._lock:
                    current = self._policies.get((policy.uid, policy.name), policy)
                if current.drained_checkpoint_id:  # drained meanwhile (another drain)
                    return current, ""
                return self._drain_held(current)
        except CkptdError as exc:
            return None, f"{policy.name} (pid {policy.pid}): {exc}"
        except Exception as exc:  # one job's surprise must not cost the others their drain
            log.exception("drain of %s failed unexpectedly", policy.name)
            return None, f"{policy.name} (pid {policy.pid}): internal error: {exc}"

    def _drain_held(self, policy: Policy) -> tuple[Policy | None, str]:
        try:
            record = self._dump(Caller(uid=policy.uid), DumpRequest(
                pid=policy.pid, leave_running=False, name=policy.name, keep=policy.keep,
                files_dirs=policy.files_dirs))
        except CkptdError as exc:
            self._update(policy, last_error=str(exc))
            return None, f"{policy.name} (pid {policy.pid}): {exc}"
        return self._update(policy, last_fired=self._clock.time(), last_error="",
                            last_checkpoint_id=record.id,
                            drained_checkpoint_id=record.id), ""

    def resume(
        self, caller: Caller, name: str = ""
    ) -> tuple[builtins.list[RestoreOutcome], builtins.list[str]]:
        """Restore the drained job ``name`` (empty: every drained job the caller may); by
        name, also the caller's protected job that died (``clear_ended``): from the newest
        checkpoint its policy took."""
        with self._lock:
            drained = [p for p in self._policies.values() if p.drained_checkpoint_id
                       and (not name or p.name == name)
                       and (caller.is_root or p.uid == caller.uid)]
        if name and not drained:
            return [self._resume_died(caller, name)], []
        done: builtins.list[RestoreOutcome] = []
        errors: builtins.list[str] = []
        for policy in drained:
            if not caller.is_root and policy.uid != caller.uid:
                continue
            try:
                outcome = self._restore(
                    Caller(uid=policy.uid),
                    RestoreRequest(checkpoint_id=policy.drained_checkpoint_id),
                )
            except CkptdError as exc:
                errors.append(f"{policy.name}: {exc}")
                continue
            self._update(policy, pid=outcome.pid, drained_checkpoint_id="",
                         started=self._processes.status(outcome.pid).start_time)
            done.append(outcome)
            self._events.publish(EventKind.RESUME, pid=outcome.pid, uid=policy.uid,
                                 checkpoint_id=outcome.checkpoint_id, name=policy.name,
                                 message=f"{policy.name} resumed as pid {outcome.pid}")
        return done, errors

    def _resume_died(self, caller: Caller, name: str) -> RestoreOutcome:
        """The caller's job ``name``, not drained, restored from the newest checkpoint its
        policy took, once its process is gone; refused while it runs (the restored process
        of an earlier resume too) and while another checkpoint or resume of it is under way."""
        with self._lock:
            found = self._find(caller, name)
        if found is None:
            raise CheckpointNotFound(
                f"no protected job named {name!r} here (a job that ended on its own leaves "
                "no policy)",
                hint=f"`ckptctl list --name {name}` shows its checkpoints, `ckptctl restore "
                     f"--name {name}` restores the newest")
        self._check_owner(caller, found)
        with self._holding(found, wait_s=0.0, doing="checkpointed or resumed"):
            with self._lock:
                policy = self._policies.get((found.uid, name), found)
            if policy.pid and self._alive(policy):
                raise PreconditionFailed(
                    f"job {name!r} still runs as pid {policy.pid}: nothing to resume",
                    pid=policy.pid,
                    hint=f"`ckptctl dump --name {name}` checkpoints and stops it")
            if not policy.last_checkpoint_id:
                raise CheckpointNotFound(
                    f"job {name!r} is not drained and has no checkpoint of its policy",
                    hint="see `ckptctl policy show` and `ckptctl list --name NAME`")
            outcome = self._restore(Caller(uid=policy.uid),
                                    RestoreRequest(checkpoint_id=policy.last_checkpoint_id))
            self._update(policy, pid=outcome.pid, last_error="",
                         started=self._processes.status(outcome.pid).start_time)
        self._events.publish(EventKind.RESUME, pid=outcome.pid, uid=policy.uid,
                             checkpoint_id=outcome.checkpoint_id, name=name,
                             message=f"{name} resumed as pid {outcome.pid} after it died")
        return outcome

    def spot_notice(
        self, source: str, detail: str
    ) -> tuple[builtins.list[Policy], builtins.list[str]]:
        """The cloud is taking the node back: checkpoint every protected job now."""
        self._events.publish(EventKind.SPOT_NOTICE, message=f"{source}: {detail}",
                             source=source)
        log.warning("spot notice from %s (%s): draining protected jobs", source, detail)
        return self.drain(ROOT, reason=f"spot notice ({source})")

    # ---- helpers ----------------------------------------------------------------------------

    def _on_event(self, event: Event) -> None:
        """A job restored by hand (``ckptctl restore``) is the same job, in a new process:
        its policy follows it."""
        if event.kind is not EventKind.RESTORE_DONE or not event.pid:
            return
        with self._lock:
            moved = [p for p in self._policies.values()
                     if p.pid == event.pid and not p.drained_checkpoint_id]
        for policy in moved:
            self._update(policy, started=self._processes.status(event.pid).start_time)

    def _only_child(self, caller: Caller) -> int:
        if not caller.pid:
            raise InvalidTarget("the caller's process is unknown", hint="give the job's pid")
        with caller_process(self._processes, caller, "its child was found"):
            try:
                tree = self._processes.tree(caller.pid)
            except CkptdError as exc:
                raise InvalidTarget(f"the caller (pid {caller.pid}) is gone") from exc
        kids = [p.pid for p in tree if p.ppid == caller.pid]
        if len(kids) != 1:
            raise InvalidTarget(
                f"the caller (pid {caller.pid}) has {len(kids)} child processes, not one",
                hint="give the job's pid",
            )
        return kids[0]

    def _alive(self, policy: Policy) -> bool:
        """Whether the policy's job still runs here: its pid is alive AND is still the same
        process (same start time). A pid that now belongs to another process is forgotten."""
        status = self._processes.status(policy.pid)
        if status.state not in (PidState.RUNNING, PidState.STOPPED):
            return False
        if policy.started and status.start_time and status.start_time != policy.started:
            log.warning("policy %s: pid %d now belongs to another process (%s); forgetting it",
                        policy.name, policy.pid, status.comm)
            self._update(policy, pid=0, started=0,
                         last_error=f"pid {policy.pid} now belongs to another process "
                         f"({status.comm}); the job is gone")
            return False
        return True

    def _update(self, of: Policy, **changes: object) -> Policy:
        """Change the policy of ``of``'s owner and name as it is now."""
        key = (of.uid, of.name)
        with self._lock:
            current = self._policies.get(key)
            if current is None:  # cleared meanwhile (never while busy): nothing to record
                return replace(of, **changes)  # type: ignore[arg-type]
            policy = replace(current, **changes)  # type: ignore[arg-type]
            self._policies[key] = policy
            self._save()
            return policy

    def _find(self, caller: Caller, name: str) -> Policy | None:
        """The policy of ``name`` the caller means: its own; for root, the one of that name,
        refused (InvalidTarget) when several owners have one. Under ``_lock``."""
        if not caller.is_root:
            return self._policies.get((caller.uid, name))
        found = [p for p in self._policies.values() if p.name == name]
        if len(found) > 1:
            raise InvalidTarget(
                f"jobs named {name!r} belong to uids "
                f"{', '.join(str(p.uid) for p in sorted(found, key=lambda p: p.uid))}: which "
                "one is meant cannot be told",
                hint="run the command as the job's owner (e.g. `sudo -u OWNER ckptctl ...`)")
        return found[0] if found else None

    def _save(self) -> None:
        self._repo.save(sorted(self._policies.values(), key=lambda p: (p.name, p.uid)))

    @staticmethod
    def _check_owner(caller: Caller, policy: Policy) -> None:
        if not caller.is_root and policy.uid != caller.uid:
            raise PermissionDenied(
                f"the policy of {policy.name} belongs to uid {policy.uid}, the caller is uid "
                f"{caller.uid}"
            )


def describe(policy: Policy) -> str:
    parts = [f"job {policy.name}"]
    if policy.pid:
        parts.append(f"pid {policy.pid}")
    if policy.every_s:
        parts.append(f"every {policy.every_s:g}s")
    if policy.keep:
        parts.append(f"keep {policy.keep}")
    if policy.on_term:
        parts.append("protected")
    return ", ".join(parts)
