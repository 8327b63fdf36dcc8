"""Root filesystems and OCI bundles for real containers in tests (runc, crun, podman).

No image registry here, so the root filesystem is built locally, the way a distroless image
with the node's runtime would look: a directory holding only what an image's root holds
(/etc's few files, the merged-/usr symlinks, mount points) while the node's ``/usr``, the
Python the checkout's ``.venv`` was made from, the ``.venv`` itself and the checkout are
bind-mounted read-only at the same paths. A Python job, ``ckptctl`` (ckptd and gRPC from the
venv) and CRIU (``/usr/local/sbin/criu`` and its libraries, under ``/usr``) all run inside.
Building it is a few ``mkdir``/``symlink`` calls (milliseconds; a second build finds its
marker and does nothing), against ~1-2 minutes for a debootstrap minbase, which would still
need the node's Python for gRPC. See docs/design/containers.md, "Test set-up".

    python -m tests.containers.bundle ROOTFS [BUNDLE NAME -- CMD ...]

builds ROOTFS (and a bundle for runc/crun running CMD). Everything takes explicit paths:
tests build into their own temporary directories, or share one ROOTFS per session.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
ROOTFS_VERSION = "ckptd-test-rootfs 1"
"""Written in the root filesystem's marker; a different one rebuilds."""

_MARKER = ".ckptd-rootfs"


def python_home() -> Path:
    """The installation the venv's python comes from (``home`` in pyvenv.cfg)."""
    venv = venv_dir()
    cfg = (venv / "pyvenv.cfg").read_text()
    home = next(line.split("=", 1)[1].strip() for line in cfg.splitlines()
                if line.startswith("home"))
    base = Path(home).resolve()
    return base.parent if base.name == "bin" else base


def venv_dir() -> Path:
    """The venv whose python runs ckptd here: the checkout's .venv, followed through
    symlinks (a worktree's .venv may link to another checkout's)."""
    venv = CHECKOUT / ".venv"
    if (venv / "bin").is_symlink():
        return (venv / "bin").resolve().parent
    return venv.resolve()


def host_binds() -> list[tuple[Path, Path]]:
    """(source, destination) of the node's paths a test container needs, read-only: /usr
    (libraries, CRIU, coreutils), the python installation, the venv and the checkout."""
    binds = [(Path("/usr"), Path("/usr")), (python_home(), python_home()),
             (venv_dir(), venv_dir()), (CHECKOUT, CHECKOUT)]
    if not str(python_home()).startswith("/usr/"):
        return binds
    return [b for b in binds if b[0] != python_home()]


def build_rootfs(dest: Path) -> float:
    """Make ``dest`` a root filesystem for test containers; seconds it took (0 when it was
    already there). Idempotent; safe to share between containers (they mount it read-only)."""
    marker = dest / _MARKER
    if marker.exists() and marker.read_text() == ROOTFS_VERSION:
        return 0.0
    started = time.monotonic()
    if dest.exists():
        shutil.rmtree(dest)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for link, target in (("bin", "usr/bin"), ("sbin", "usr/sbin"), ("lib", "usr/lib"),
                         ("lib64", "usr/lib64")):
        (tmp / link).symlink_to(target)
    for sub in ("usr", "proc", "sys", "dev", "tmp", "run/ckptd", "data", "root", "etc",
                "var/tmp", "var/lib/ckptd"):
        (tmp / sub).mkdir(parents=True, exist_ok=True)
    (tmp / "tmp").chmod(0o1777)
    for _, mountpoint in host_binds():
        (tmp / mountpoint.relative_to("/")).mkdir(parents=True, exist_ok=True)
    etc = tmp / "etc"
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n"
                                "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
    (etc / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (etc / "hostname").write_text("ckptd-test\n")
    (etc / "hosts").write_text("127.0.0.1 localhost\n::1 localhost\n")
    (etc / "nsswitch.conf").write_text("passwd: files\ngroup: files\nhosts: files\n")
    (tmp / _MARKER).write_text(ROOTFS_VERSION)
    tmp.rename(dest)
    return time.monotonic() - started


@dataclass
class ContainerSpec:
    """What a test container is: its root filesystem, command, volumes, cgroup."""

    rootfs: Path
    args: Sequence[str]
    hostname: str = "ckptd-test"
    volumes: Mapping[Path, Path] = field(default_factory=dict)
    """Host directory -> path in the container, read-write (the job's data, the daemon's
    socket directory)."""
    env: Mapping[str, str] = field(default_factory=dict)
    cgroups_path: str = ""
    """cgroup (v2, relative to /sys/fs/cgroup) the runtime puts the container in."""
    cwd: str = "/"
    node_binds: bool = True
    """Bind the node's /usr, python, venv and checkout (False: a root filesystem of its own,
    e.g. debootstrap's, with nothing of the node's)."""
    hide: Sequence[str] = ()
    """Paths of the node's binds hidden in the container by an empty read-only tmpfs (e.g.
    /usr/local/sbin: no CRIU in the container's root filesystem)."""


def oci_config(spec: ContainerSpec) -> dict[str, object]:
    """An OCI runtime config (what ``runc spec`` writes, edited): own pid, mount, network,
    ipc, uts and cgroup namespaces; read-only root; the node's binds read-only; volumes."""
    config = _runtime_spec_template()
    path = f"{venv_dir()}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"
    env = {"PATH": path, "HOME": "/root", "PYTHONPATH": str(CHECKOUT),
           "PYTHONDONTWRITEBYTECODE": "1", **spec.env}
    process = config["process"]
    assert isinstance(process, dict)
    process.update(terminal=False, args=list(spec.args), cwd=spec.cwd,
                   env=[f"{k}={v}" for k, v in env.items()])
    config["root"] = {"path": str(spec.rootfs), "readonly": True}
    config["hostname"] = spec.hostname
    mounts = config["mounts"]
    assert isinstance(mounts, list)
    mounts.append({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
                   "options": ["nosuid", "nodev", "mode=1777"]})
    for source, dest in host_binds() if spec.node_binds else ():
        mounts.append({"destination": str(dest), "type": "bind", "source": str(source),
                       "options": ["rbind", "ro"]})
    for source, dest in spec.volumes.items():
        mounts.append({"destination": str(dest), "type": "bind", "source": str(source),
                       "options": ["rbind", "rw"]})
    for hidden in spec.hide:
        mounts.append({"destination": hidden, "type": "tmpfs", "source": "tmpfs",
                       "options": ["ro", "nosuid", "nodev", "size=4k"]})
    linux = config["linux"]
    assert isinstance(linux, dict)
    kinds = {ns["type"] for ns in linux["namespaces"]}
    linux["namespaces"] += [{"type": k} for k in ("cgroup",) if k not in kinds]
    if spec.cgroups_path:
        linux["cgroupsPath"] = spec.cgroups_path
    return config


def write_bundle(bundle: Path, spec: ContainerSpec) -> Path:
    """A bundle directory (config.json; the root is ``spec.rootfs``, outside it)."""
    bundle.mkdir(parents=True, exist_ok=True)
    (bundle / "config.json").write_text(json.dumps(oci_config(spec), indent=1))
    return bundle


def podman_argv(spec: ContainerSpec, name: str) -> list[str]:
    """``podman run --rootfs`` for the same container (no image, no registry)."""
    argv = ["podman", "run", "--rm", "--name", name, "--hostname", spec.hostname,
            "--network", "none", "--cgroupns", "private", "--ipc", "private",
            "--pid", "private", "--read-only", "--tmpfs", "/tmp",
            # our own limits: podman raises RLIMIT_NOFILE (and NPROC) by default, which
            # needs CAP_SYS_RESOURCE (these machines' root lacks it)
            *_podman_ulimits()]
    rt = runtime()
    if rt is not None:
        argv += ["--runtime", rt]  # Debian's podman picks crun, which refuses hybrid cgroups
    for hidden in spec.hide:
        argv += ["--tmpfs", f"{hidden}:ro,size=4k,notmpcopyup"]
    for source, dest in host_binds():
        argv += ["-v", f"{source}:{dest}:ro"]
    for source, dest in spec.volumes.items():
        argv += ["-v", f"{source}:{dest}:rw"]
    for key, value in spec.env.items():
        argv += ["-e", f"{key}={value}"]
    argv += ["-e", f"PYTHONPATH={CHECKOUT}", "-e", f"PATH={venv_dir()}/bin:/usr/sbin:/usr/bin"]
    if spec.cgroups_path:
        argv += ["--cgroup-parent", os.path.dirname("/" + spec.cgroups_path.strip("/"))]
    return [*argv, "--rootfs", str(spec.rootfs), *spec.args]


def _podman_ulimits() -> list[str]:
    """Limits podman may set: ours for open files, a modest one for processes. Podman raises
    both by default, which needs CAP_SYS_RESOURCE (these machines' root lacks it; seen: any
    nproc from 65536 up refused, even below our hard limit)."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    argv = ["--ulimit", "nproc=4096:4096"]
    if resource.RLIM_INFINITY not in (soft, hard):
        argv += ["--ulimit", f"nofile={soft}:{hard}"]
    return argv


def runtime() -> str | None:
    """The OCI runtime tests use: $CKPTD_TEST_RUNTIME, else runc, else crun."""
    wanted = os.environ.get("CKPTD_TEST_RUNTIME")
    for cand in ([wanted] if wanted else ["runc", "crun"]):
        found = shutil.which(cand)
        if found:
            return found
    return None


def _runtime_spec_template() -> dict[str, object]:
    """``runc spec`` (or ``crun spec``)'s default config, from a scratch directory."""
    rt = runtime()
    if rt is None:
        raise RuntimeError("neither runc nor crun is installed (apt-get install runc crun)")
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"ckptd-spec-{os.getpid()}"
    scratch.mkdir(exist_ok=True)
    try:
        subprocess.run([rt, "spec"], cwd=scratch, check=True, capture_output=True)
        loaded: dict[str, object] = json.loads((scratch / "config.json").read_text())
        return loaded
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: Sequence[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    took = build_rootfs(Path(argv[0]))
    print(f"rootfs {argv[0]}: " + (f"built in {took:.3f}s" if took else "already there"))
    if len(argv) >= 3:
        cmd = list(argv[3:])
        if cmd and cmd[0] == "--":
            cmd = cmd[1:]
        bundle = write_bundle(Path(argv[1]), ContainerSpec(
            rootfs=Path(argv[0]), args=cmd or ["sleep", "infinity"],
            cgroups_path=f"ckptd-test/{argv[2]}"))
        print(f"bundle {bundle}: {runtime()} run -b {bundle} {argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
