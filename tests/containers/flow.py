"""The end-to-end container flow of issue #12 (points 1-2), with raw CRIU run inside the
containers by ``ckptd.adapters.criu.containers``:

1. container A (own pid, mount, network, ipc, uts, cgroup namespaces; read-only root
   filesystem; a data volume) is created; its pid counter is moved past ``PID_BASE`` so the
   job's pids are above those any container's own processes take; started: its init (pid 1,
   standing in for ``ckptctl run``) starts the job in a session of its own;
2. the job (a tree: ``sh`` and the deterministic writer) is checkpointed by CRIU run inside
   A (the job is *not* A's init), and dies; A's init exits; A is deleted;
3. container B (same image and volume, a new init waiting to adopt a child) is run;
4. CRIU run inside B restores the tree: B's namespaces, cgroups and root, B's stdout; CRIU
   exits and the tree's root is reparented to B's init, which exits with its status;
5. the output (A's then B's stdout), the log and the state file equal an uninterrupted run's.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.adapters.criu.containers import (
    ENTERED,
    Container,
    ContainerError,
    CriuResult,
    criu_dump,
    criu_restore,
    image_pids,
    make_pids_free,
    ns_inodes,
    open_stdio_of,
    stdio_pipes,
)

from .bundle import CHECKOUT, ContainerSpec, build_rootfs
from .runtime import OciContainer, PodmanContainer

WRITER = CHECKOUT / "tests" / "integration" / "jobs" / "writer.py"
TCP_PAIR = CHECKOUT / "tests" / "integration" / "jobs" / "tcp_pair.py"
PID1 = CHECKOUT / "tests" / "containers" / "jobs" / "pid1.py"
SHIM_DIR = CHECKOUT / "native" / "enter-mntns"
SHIM = SHIM_DIR / "bin" / "ckptd_enter_mntns.so"
PID_BASE = 1000
DEFAULT_CRIU = "/usr/local/sbin/criu"


class FlowError(Exception):
    pass


def build_shim() -> Path:
    """native/enter-mntns (make; a no-op when built)."""
    done = subprocess.run(["make", "-s", "-C", str(SHIM_DIR)], capture_output=True, text=True,
                          check=False)
    if done.returncode != 0 or not SHIM.exists():
        raise FlowError(f"cannot build {SHIM}: {done.stderr.strip()}")
    return SHIM


def criu_binary() -> str:
    for cand in (os.environ.get("CKPTD_TEST_CRIU", ""), DEFAULT_CRIU, shutil.which("criu")):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise FlowError("no criu binary")


@dataclass
class Flow:
    """Paths and knobs of one run of the flow."""

    work: Path
    steps: int = 120
    interval_ms: int = 40
    dump_after_step: int = 30
    exit_status: int = 7
    preload: bool = True
    """CRIU enters the mount namespace after being loaded from the node (``SHIM``); the
    containers then hide /usr/local/sbin: no CRIU in their root filesystem."""
    pid_base: int = PID_BASE
    decoys: int = 0
    """Sleeping children B's init starts first (pids 2.., as ckptctl run's threads)."""
    rootfs_dir: Path | None = None
    """A root filesystem shared between flows (default: ``work/rootfs``)."""
    engine: str = "oci"
    """``oci``: runc or crun with a bundle (``bundle.runtime()``); ``podman``: ``podman run
    --rootfs`` (with the same OCI runtime)."""
    job: str = "writer"
    """``writer`` (a log, a state file, stdout) or ``tcp`` (two processes talking TCP over
    the container's loopback: dumped established, the network locked by nftables in the
    container's network namespace)."""
    prefix: str = field(default_factory=lambda: f"ckptd-ct-{os.getpid()}")
    timings: dict[str, float] = field(default_factory=dict)
    facts: dict[str, object] = field(default_factory=dict)

    @property
    def rootfs(self) -> Path:
        return self.rootfs_dir or self.work / "rootfs"

    @property
    def data(self) -> Path:
        return self.work / "data"

    @property
    def images(self) -> Path:
        return self.work / "images"

    def job_argv(self) -> list[str]:
        """The job: a tree (sh, then the writer or the TCP pair), exiting with
        ``exit_status``."""
        if self.job == "tcp":
            run = f"python3 {TCP_PAIR} {self.steps} {self.interval_ms}"
        else:
            run = f"python3 {WRITER} /data {self.steps} {self.interval_ms}"
        return ["sh", "-c", f"{run}; exit {self.exit_status}"]

    def spec(self, name: str, args: list[str]) -> ContainerSpec:
        return ContainerSpec(
            rootfs=self.rootfs, args=args, hostname=name,
            volumes={self.data: Path("/data")},
            cgroups_path=f"/ckptd-test/{self.prefix}-{name}",
            hide=("/usr/local/sbin",) if self.preload else ())

    def container(self, name: str, args: list[str]) -> OciContainer:
        kind = PodmanContainer if self.engine == "podman" else OciContainer
        return kind(f"{self.prefix}-{name}", self.work / name, self.spec(name, args))

    # ---- the steps ---------------------------------------------------------------------

    def prepare(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        self.timings["rootfs_build_s"] = build_rootfs(self.rootfs)
        self.timings["rootfs_check_s"] = time.monotonic() - started
        for d in (self.data, self.images):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir()
        if self.preload:
            build_shim()

    def start_a(self) -> OciContainer:
        """Container A running the job under a stand-in for ``ckptctl run``, which waits
        until A's pid counter is moved past ``pid_base`` before it starts the job."""
        go = self.data / ".go"
        go.unlink(missing_ok=True)
        a = self.container("a", ["python3", str(PID1), "--wait-for", "/data/.go", "--",
                                 *self.job_argv()])
        init = a.run()
        with Container.open(init) as ns:
            if self.pid_base:
                ns.set_last_pid(self.pid_base)
        go.touch()
        a.wait_for_output(f"step {self.dump_after_step} ", timeout=30)
        go.unlink()
        return a

    def checkpoint(self, a: OciContainer) -> CriuResult:
        """CRIU run inside A dumps the job (A's init's child, pid > pid_base in A); the job
        dies, A's init exits."""
        init = a.init_pid()
        with Container.open(init) as ns:
            kids = Path(f"/proc/{init}/task/{init}/children").read_text().split()
            if len(kids) != 1:
                raise FlowError(f"A's init has children {kids}, expected the job alone")
            job = int(kids[0])
            ns_pid = next(p for p, n in ns.node_pids().items() if n == job)
            self.facts["a_job_ns_pid"] = ns_pid
            self.facts["a_namespaces"] = dict(ns.inodes)
            self.facts["a_stdio"] = stdio_pipes(job)
            self.facts["a_seccomp"] = int(next(
                ln.split()[1] for ln in Path(f"/proc/{job}/status").read_text().splitlines()
                if ln.startswith("Seccomp:")))
            # The tree is left stopped and killed only once CRIU has exited (as ckptd's dump
            # recipe does): CRIU is a process of A's pid namespace, and A's init exits when
            # its job dies, which makes the kernel kill every process of the namespace,
            # CRIU included (seen: CRIU killed by SIGKILL after a complete dump).
            tree = [os.pidfd_open(node) for p, node in ns.node_pids().items() if p != 1]
            try:
                result = criu_dump(ns, criu_binary(), self.images, ns_pid,
                                   preload=SHIM if self.preload else None,
                                   tcp_established=self.job == "tcp",
                                   extra=["--leave-stopped"])
                self.timings["dump_s"] = result.seconds
                if result.returncode != 0:
                    raise FlowError(f"dump failed ({result.returncode}): "
                                    f"{result.first_error()}")
                for fd in tree:
                    with suppress(ProcessLookupError):
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
            finally:
                for fd in tree:
                    os.close(fd)
        return result

    def remove(self, c: OciContainer) -> None:
        deadline = time.monotonic() + 10
        while c.status() == "running" and time.monotonic() < deadline:
            time.sleep(0.02)
        c.delete()
        c.drain()

    def start_b(self) -> OciContainer:
        """Container B: a new init waiting for the job (``pid1.py --adopt``), run in the
        foreground so that its exit status is the runtime's."""
        decoys = ["--decoys", str(self.decoys)] if self.decoys else []
        b = self.container("b", ["python3", str(PID1), "--adopt", *decoys])
        b.run()
        return b

    def restore_into(self, b: OciContainer, *, check_pids: bool = True) -> tuple[CriuResult, int]:
        """CRIU run inside B restores the job there; returns CRIU's result and the node pid
        of the restored root. ``check_pids=False`` skips the check that the image's pids are
        free in B (to see what CRIU says)."""
        init = b.init_pid()
        if self.decoys:
            b.wait_for_output_err("waiting for a child", timeout=20)
        stdio = self.facts["a_stdio"]
        assert isinstance(stdio, dict)
        with Container.open(init) as ns:
            pids = image_pids(self.images)
            started = time.monotonic()
            if check_pids:
                make_pids_free(ns, pids)
            self.timings["pids_free_s"] = time.monotonic() - started
            ours = open_stdio_of(init, sorted(stdio))
            try:
                inherit = {key: ours[fd] for fd, key in stdio.items()}
                result = criu_restore(ns, criu_binary(), self.images,
                                      preload=SHIM if self.preload else None, inherit=inherit,
                                      tcp_established=self.job == "tcp")
            finally:
                for fd in ours.values():
                    os.close(fd)
            self.timings["restore_s"] = result.seconds
            if result.returncode != 0:
                raise FlowError(f"restore failed ({result.returncode}): "
                                f"{result.first_error()}")
            root = ns.node_pids().get(pids[0])
            if root is None:
                raise FlowError(f"restored root (pid {pids[0]} in B) not found")
            self.facts["b_namespaces"] = dict(ns.inodes)
            self.facts["b_cgroup"] = Path(f"/proc/{init}/cgroup").read_text()
        return result, root

    def observe(self, root: int, b_init: int) -> dict[str, object]:
        """What /proc says of the restored root, against B's init."""
        status = Path(f"/proc/{root}/status").read_text()
        ppid = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("PPid:")))
        nspid = next(ln.split()[1:] for ln in status.splitlines() if ln.startswith("NSpid:"))
        seccomp = next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Seccomp:"))
        return {
            "seccomp": int(seccomp),
            "ppid_is_b_init": ppid == b_init,
            "ns_pid": int(nspid[-1]),
            "namespaces_equal": {k: ns_inodes(root, (k,))[k] == ns_inodes(b_init, (k,))[k]
                                 for k in ENTERED},
            "cgroup_equal": Path(f"/proc/{root}/cgroup").read_text()
                            == Path(f"/proc/{b_init}/cgroup").read_text(),
            "root_equal": os.stat(f"/proc/{root}/root").st_ino
                          == os.stat(f"/proc/{b_init}/root").st_ino,
        }

    def reference(self) -> tuple[bytes, bytes, bytes]:
        """stdout, train.log and state.bin of an uninterrupted run of the job (the TCP pair
        writes no files: b"", b"")."""
        ref = self.work / "reference"
        shutil.rmtree(ref, ignore_errors=True)
        ref.mkdir()
        if self.job == "tcp":
            out = subprocess.run([sys.executable, str(TCP_PAIR), str(self.steps), "0"],
                                 capture_output=True, check=True).stdout
            return out, b"", b""
        out = subprocess.run([sys.executable, str(WRITER), str(ref), str(self.steps), "0"],
                             capture_output=True, check=True).stdout
        return out, (ref / "train.log").read_bytes(), (ref / "state.bin").read_bytes()

    def run(self) -> dict[str, object]:
        """The whole flow; returns what was observed (raises FlowError where it stops)."""
        self.prepare()
        a = self.start_a()
        b: OciContainer | None = None
        try:
            self.checkpoint(a)
            self.remove(a)
            self.facts["a_status_after_dump"] = a.status()
            started = time.monotonic()
            b = self.start_b()
            self.timings["b_start_s"] = time.monotonic() - started
            _, root = self.restore_into(b)
            self.timings["b_start_to_running_s"] = time.monotonic() - started
            self.facts["restored"] = self.observe(root, b.init_pid())
            rc = b.wait(timeout=self.steps * self.interval_ms / 1000 + 60)
            self.facts["b_exit_status"] = rc
            out, log, state = self.reference()
            got = a.out.read_bytes() + b.out.read_bytes()
            self.facts["stdout_equal"] = got == out
            written = [self.data / "train.log", self.data / "state.bin"]
            log_now, state_now = (p.read_bytes() if p.exists() else b"" for p in written)
            self.facts["log_equal"] = log_now == log
            self.facts["state_equal"] = state_now == state
            self.facts["b_stderr"] = b.err.read_text(errors="replace").strip()
        except ContainerError as exc:
            raise FlowError(str(exc)) from exc
        finally:
            a.delete()
            if b is not None:
                b.delete()
        return {"timings": self.timings, **self.facts}
