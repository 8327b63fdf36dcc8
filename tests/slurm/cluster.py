"""A real Slurm cluster on this machine for the slurm tier: Debian's slurm-wlm 22.05 and munge.

``SlurmCluster`` starts, under one directory of its own:

- ``munged`` (its own key and socket; slurm.conf's ``AuthInfo=socket=``);
- two "nodes", the network namespaces ``a`` and ``b`` of a ``TwoNodes`` pair (a veth between
  them): ``slurmctld`` and ``slurmd -N node1`` in ``a``, ``slurmd -N node2`` in ``b``, each
  entered with setns(CLONE_NEWNET) only (``in_netns``: CRIU refuses a job whose mount
  namespace is not the daemon's, and ``ip netns exec`` would make one);
- one ckptd per node in the same namespace, each with its own socket and state directory and
  one store directory for both (a store the nodes share, as on NFS);
- the node's Prolog, Epilog and TaskProlog: ``deploy/slurm/prolog.sh`` and ``epilog.sh`` as
  shipped, run through a two-line wrapper that gives them what a node installed per
  deploy/README.md has at its defaults — ``ckptctl`` on PATH (slurmd runs them with no PATH)
  and the node's ckptd socket — and a TaskProlog exporting ``CKPTD_SOCKET`` to the job (the
  documented way for a site whose socket is not /run/ckptd/ckptd.sock).

Configured as issue 26 asks: two partitions, ``low`` (PriorityTier 1, ``PreemptMode=REQUEUE``,
``GraceTime``) and ``high`` (PriorityTier 10), ``PreemptType=preempt/partition_prio``,
``JobRequeue=1``; short timers (``SlurmdTimeout``, ``KillWait``, ``cred_expire``: a requeued
job waits ``cred_expire`` seconds before it may start again, 120 by default) so that a flow
takes seconds, and the main scheduling loop every 2 s (``sched_interval``, 60 by default: a
requeued job whose begin time has passed waits for it). ``proctrack/linuxproc``: these hosts
mount cgroup v1 controllers (two slurmd on one host could not share a v1 hierarchy cleanly),
so Slurm tracks a job's processes by descent from slurmstepd; a tree ckptd restored is not
one of them (as with cgroups on this host, ADR 0010). Every client command runs in namespace
``a`` with ``SLURM_CONF`` set.

``close()`` stops everything it started, also after a failure half way; the directory (logs:
``log/``) stays for the test's report.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.integration.conftest import criu_path
from tests.integration.netns import TwoNodes, in_netns, netns_path
from tests.integration.support import REPO, VENV_BIN, Daemon
from tests.jobshapes.shapes import kill_tree

SLURM_DEPLOY = REPO / "deploy" / "slurm"
NODES = ("node1", "node2")
GRACE_TIME_S = 20
"""Partition low's GraceTime: a preempted job's checkpoint is taken within it."""
CRED_EXPIRE_S = 10
"""AuthInfo's cred_expire: a requeued job starts again no sooner (its begin time)."""
SLURMD_TIMEOUT_S = 10
"""A node not answering this long is DOWN and its jobs requeued."""
BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "slurmstepd", "sbatch", "scontrol",
            "squeue", "srun")

SLURM_CONF = """\
ClusterName=ckptdtest
SlurmctldHost={host}({addr_a})
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire={cred_expire}
StateSaveLocation={root}/ctld
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/ctld/slurmctld.pid
SlurmdPidFile={root}/spool/%n/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=debug
SlurmdDebug=debug
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdTimeout={slurmd_timeout}
MessageTimeout=5
KillWait=5
MinJobAge=600
JobRequeue=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
Prolog={root}/prolog.sh
Epilog={root}/epilog.sh
TaskProlog={root}/taskprolog.sh
NodeName=node1 NodeAddr={addr_a} NodeHostname=node1 CPUs=2 RealMemory=1000 State=UNKNOWN
NodeName=node2 NodeAddr={addr_b} NodeHostname=node2 CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=low Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP PriorityTier=1 \
PreemptMode=REQUEUE GraceTime={grace}
PartitionName=high Nodes=node1,node2 MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""

NODE_ENV = """\
# What a node installed per deploy/README.md has at its defaults: ckptctl on PATH, its
# daemon's socket (here one per node, by the node's name).
export PATH={venv_bin}:/usr/sbin:/usr/bin:/sbin:/bin
export CKPTD_SOCKET={root}/node/$SLURMD_NODENAME/ckptd.sock
"""
HOOK = "#!/bin/bash\n. {root}/node-env.sh\nexec {script}\n"
TASK_PROLOG = "#!/bin/bash\necho \"export CKPTD_SOCKET={root}/node/$SLURMD_NODENAME/ckptd.sock\"\n"


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


class SlurmCluster:
    """munged, slurmctld, two slurmd and their ckptd daemons under ``root`` (see the module)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.log_dir = root / "log"
        self.conf = root / "slurm.conf"
        self.nodes = TwoNodes()
        self.daemons: dict[str, Daemon] = {}
        self._procs: list[subprocess.Popen[Any]] = []
        self._starting = False
        self._munge_socket = root / "munge-run" / "munge.socket"
        self.netns = {"node1": self.nodes.a.name, "node2": self.nodes.b.name}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf),
                    "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"}

    # ---- start, stop ----------------------------------------------------------------------

    def start(self) -> SlurmCluster:
        """Everything up, nodes idle; on failure what was started is stopped and the error
        says which part failed (with its log's tail)."""
        self._starting = True
        try:
            self.nodes.__enter__()
            for d in ("log", "ctld", "munge-run", "munge-key", "spool/node1", "spool/node2",
                      "node/node1", "node/node2"):
                (self.root / d).mkdir(parents=True, exist_ok=True)
            self._start_munge()
            self._write_config()
            self._start_ckptd()
            self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)], "node1")
            for node in NODES:
                self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-f", str(self.conf), "-N", node],
                            node)
            self.wait_nodes("idle", NODES, timeout=60)
        except BaseException:
            self.close()
            raise
        self._starting = False
        return self

    def _start_munge(self) -> None:
        key_dir = self.root / "munge-key"
        key_dir.chmod(0o700)
        (self.root / "munge-run").chmod(0o755)
        key = key_dir / "munge.key"
        subprocess.run(["mungekey", "-c", "-b", "1024", "-k", str(key)], check=True,
                       capture_output=True, timeout=30)
        self._spawn("munged", ["munged", "-F", "-f", f"--socket={self._munge_socket}",
                               f"--key-file={key}", f"--log-file={self.log_dir}/munged.log",
                               f"--pid-file={self.root}/munge-run/munged.pid",
                               f"--seed-file={key_dir}/munged.seed"], None)
        self._wait(self._munge_socket.is_socket, 20, "munged's socket",
                   self.log_dir / "munged.log")

    def _write_config(self) -> None:
        self.conf.write_text(SLURM_CONF.format(
            host=socket.gethostname(), addr_a=self.nodes.a.address,
            addr_b=self.nodes.b.address, root=self.root, munge_socket=self._munge_socket,
            cred_expire=CRED_EXPIRE_S, slurmd_timeout=SLURMD_TIMEOUT_S, grace=GRACE_TIME_S))
        (self.root / "cgroup.conf").write_text(
            "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n")
        (self.root / "node-env.sh").write_text(NODE_ENV.format(venv_bin=VENV_BIN,
                                                               root=self.root))
        for name, text in (
            ("prolog.sh", HOOK.format(root=self.root, script=SLURM_DEPLOY / "prolog.sh")),
            ("epilog.sh", HOOK.format(root=self.root, script=SLURM_DEPLOY / "epilog.sh")),
            ("taskprolog.sh", TASK_PROLOG.format(root=self.root)),
        ):
            path = self.root / name
            path.write_text(text)
            path.chmod(0o755)

    def _start_ckptd(self) -> None:
        criu = criu_path()
        for node in NODES:
            self.start_ckptd(node, *(["--criu", criu] if criu else []))

    def start_ckptd(self, node: str, *extra: str) -> Daemon:
        """The node's ckptd (again, after a node failure): its socket, state, the shared
        store."""
        root = self.root / "ckptd" / node
        root.mkdir(parents=True, exist_ok=True)
        self.daemons[node] = Daemon(
            root, "--store", str(self.store), *extra,
            config={"node": node}, socket_dir=self.root / "node" / node,
            preexec_fn=in_netns(self.netns[node]))
        return self.daemons[node]

    @property
    def store(self) -> Path:
        return self.root / "store"

    def start_slurmd(self, node: str) -> None:
        self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-f", str(self.conf), "-N", node], node)

    def _spawn(self, name: str, argv: list[str], node: str | None) -> subprocess.Popen[Any]:
        with open(self.log_dir / f"{name}.stderr", "ab") as err:
            proc: subprocess.Popen[Any] = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=self.env,
                cwd=self.root, start_new_session=True,
                preexec_fn=in_netns(self.netns[node]) if node else None,  # noqa: PLW1509
            )
        proc.args = name
        self._procs.append(proc)
        return proc

    def fail_node(self, node: str) -> list[int]:
        """The node fails: SIGKILL at once to its slurmd, every slurmstepd in its network
        namespace (the jobs' steps) with their descendants, and its ckptd with its children.
        Returns the pids killed, all gone."""
        ns_inode = os.stat(netns_path(self.netns[node])).st_ino
        roots = [self.proc(f"slurmd-{node}").pid, self.daemons[node].pid]
        for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
            with contextlib.suppress(OSError):
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                if comm == "slurmstepd" and os.stat(f"/proc/{pid}/ns/net").st_ino == ns_inode:
                    roots.append(pid)
        killed: list[int] = []
        for root in roots:
            killed += kill_tree(root)
        self.proc(f"slurmd-{node}").wait(timeout=10)
        self.daemons[node].proc.wait(timeout=10)
        return killed

    def proc(self, name: str) -> subprocess.Popen[Any]:
        """The running process started as ``name`` (``slurmd-node1``, ...)."""
        return next(p for p in reversed(self._procs) if p.args == name)

    def close(self) -> None:
        """Best effort, idempotent: jobs cancelled, daemons stopped, namespaces removed."""
        if any(p.poll() is None for p in self._procs if p.args == "slurmctld"):
            with contextlib.suppress(Exception):
                self.run(["scancel", "--full", "--user=root"], timeout=15, check=False)
        for proc in reversed(self._procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self._procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self._procs.clear()
        for daemon in self.daemons.values():
            daemon.stop()
        self.nodes.close()

    # ---- clients --------------------------------------------------------------------------

    def run(self, argv: Sequence[str], timeout: float = 30, check: bool = True,
            cwd: Path | None = None) -> str:
        """A Slurm client command in namespace ``a``; its stdout (raises with stderr)."""
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                             env=self.env, cwd=cwd or self.root, check=False,
                             preexec_fn=in_netns(self.nodes.a.name))
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {res.returncode}: "
                                 f"{res.stderr.strip()}")
        return res.stdout

    def sbatch(self, *args: str, cwd: Path) -> int:
        out = self.run(["sbatch", "--parsable", *args], cwd=cwd)
        return int(out.strip().split(";")[0])

    def job(self, job: int) -> dict[str, str]:
        """``scontrol show job -o``'s fields (JobState, Restarts, NodeList, Reason, ...)."""
        text = self.run(["scontrol", "show", "job", "-o", str(job)])
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def node_states(self) -> dict[str, str]:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"])
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_nodes(self, state: str, nodes: Sequence[str], timeout: float) -> None:
        def ready() -> bool:
            states = self.node_states()
            return all(states.get(n, "").rstrip("*~#") == state for n in nodes)
        self._wait(ready, timeout, f"nodes {', '.join(nodes)} {state}",
                   self.log_dir / "slurmctld.log")

    def wait_job(self, job: int, states: Sequence[str], timeout: float) -> dict[str, str]:
        """Until the job is in one of ``states``; its fields then."""
        seen: dict[str, str] = {}

        def reached() -> bool:
            seen.update(self.job(job))
            return seen.get("JobState") in states
        self._wait(reached, timeout, f"job {job} {'/'.join(states)} (last: {seen})",
                   self.log_dir / "slurmctld.log")
        return seen

    def _wait(self, predicate: Any, timeout: float, what: str, log: Path) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            dead = [p.args for p in self._procs if p.poll() is not None]
            if time.monotonic() > deadline or (dead and self._starting):
                raise AssertionError(f"no {what} within {timeout:g}s (exited: {dead}); "
                                     f"{log}:\n{tail(log)}")
            time.sleep(0.2)

    def logs(self) -> str:
        """The tail of every log: what a failed test prints."""
        parts = [f"== {p}\n{tail(p)}" for p in sorted(self.log_dir.iterdir())]
        parts += [f"== {d.log_path}\n{tail(d.log_path)}" for d in self.daemons.values()]
        return "\n".join(parts)


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(unreadable: {exc})"
