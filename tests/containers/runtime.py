"""Containers under a real OCI runtime (runc or crun: the same command line), for tests and the
prototype. Each container's stdio is a pipe read by a thread into a file, as containerd's shim
or conmon would (a file of the node opened by the runtime would be outside the container's
mount namespace: CRIU inside it could not name it)."""

from __future__ import annotations

import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from .bundle import ContainerSpec, runtime, write_bundle


class RuntimeError_(Exception):
    pass


@dataclass
class OciContainer:
    """One container: ``create`` (then ``start``) or ``run`` (the runtime stays its parent:
    ``wait`` gives the init's exit status)."""

    name: str
    bundle: Path
    spec: ContainerSpec
    runtime: str = field(default_factory=lambda: runtime() or "runc")
    out: Path = field(init=False)
    err: Path = field(init=False)
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _pumps: list[threading.Thread] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        write_bundle(self.bundle, self.spec)
        self.out = self.bundle / "stdout"
        self.err = self.bundle / "stderr"

    @property
    def pid_file(self) -> Path:
        return self.bundle / "init.pid"

    def init_pid(self, wait_s: float = 10.0) -> int:
        """The node pid of the container's init (pid 1 of its pid namespace)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                text = self.pid_file.read_text().strip()
                if text:
                    return int(text)
            except OSError:
                pass
            exited = self._proc is not None and self._proc.poll() is not None
            if exited or time.monotonic() > deadline:
                time.sleep(0.1)  # its stderr
                why = "the runtime exited" if exited else f"none after {wait_s}s"
                raise RuntimeError_(f"container {self.name}: no init pid, {why} "
                                    f"({self._stderr_tail()})")
            time.sleep(0.01)

    def create(self) -> int:
        """``create``: namespaces and init made, the command not started; its init pid."""
        self._reset()
        proc = subprocess.Popen(
            [self.runtime, "create", "--bundle", str(self.bundle), "--pid-file",
             str(self.pid_file), self.name],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._pump(proc)
        rc = proc.wait(timeout=60)
        if rc != 0:
            time.sleep(0.1)
            raise RuntimeError_(f"{self.runtime} create {self.name} failed ({rc}): "
                                f"{self._stderr_tail()}")
        return self.init_pid()

    def _reset(self) -> None:
        self.delete()
        for path in (self.pid_file, self.out, self.err):
            path.unlink(missing_ok=True)
        self._pumps.clear()

    def start(self) -> None:
        done = subprocess.run([self.runtime, "start", self.name], capture_output=True,
                              text=True, check=False, timeout=60)
        if done.returncode != 0:
            raise RuntimeError_(f"{self.runtime} start {self.name}: {done.stderr.strip()}")

    def run(self) -> int:
        """``run`` in the foreground (the runtime waits for the init); its init pid."""
        self._reset()
        self._proc = subprocess.Popen(
            [self.runtime, "run", "--bundle", str(self.bundle), "--pid-file",
             str(self.pid_file), self.name],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._pump(self._proc)
        return self.init_pid()

    def wait(self, timeout: float) -> int:
        """The exit status of a container started with ``run`` (its init's)."""
        assert self._proc is not None
        rc = self._proc.wait(timeout=timeout)
        self.drain()
        return rc

    def drain(self, timeout: float = 10.0) -> None:
        for pump in self._pumps:
            pump.join(timeout)

    def status(self) -> str:
        done = subprocess.run([self.runtime, "state", self.name], capture_output=True,
                              text=True, check=False, timeout=30)
        if done.returncode != 0:
            return "absent"
        for line in done.stdout.splitlines():
            if '"status"' in line:
                return line.split(":", 1)[1].strip().strip('",')
        return "unknown"

    def delete(self) -> None:
        subprocess.run([self.runtime, "delete", "--force", self.name], capture_output=True,
                       check=False, timeout=60)
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()

    def wait_for_output(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in _read(self.out):
            if time.monotonic() > deadline:
                raise RuntimeError_(f"container {self.name}: {text!r} not printed in "
                                    f"{timeout}s; stderr: {self._stderr_tail()}")
            time.sleep(0.02)

    def wait_for_output_err(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in _read(self.err):
            if time.monotonic() > deadline:
                raise RuntimeError_(f"container {self.name}: {text!r} not on stderr in "
                                    f"{timeout}s: {self._stderr_tail()}")
            time.sleep(0.02)

    def _pump(self, proc: subprocess.Popen[bytes]) -> None:
        for stream, path in ((proc.stdout, self.out), (proc.stderr, self.err)):
            assert stream is not None
            thread = threading.Thread(target=_copy, args=(stream, path), daemon=True)
            thread.start()
            self._pumps.append(thread)

    def _stderr_tail(self) -> str:
        try:
            return " | ".join(self.err.read_text(errors="replace").strip().splitlines()[-3:])
        except OSError:
            return ""


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _copy(stream: IO[bytes], path: Path) -> None:
    with open(path, "ab", buffering=0) as sink:
        while chunk := stream.read1(65536):  # type: ignore[attr-defined]
            sink.write(chunk)
    stream.close()



class PodmanContainer(OciContainer):
    """The same container under ``podman run --rootfs`` (attached, ``--log-driver
    passthrough``: its stdio is our pipe; podman's own OCI runtime makes it)."""

    def __post_init__(self) -> None:
        self.bundle.mkdir(parents=True, exist_ok=True)
        self.out = self.bundle / "stdout"
        self.err = self.bundle / "stderr"

    def create(self) -> int:
        raise NotImplementedError("podman: use run (the job waits with pid1.py --wait-for)")

    def run(self) -> int:
        from .bundle import podman_argv

        self._reset()
        argv = podman_argv(self.spec, self.name)
        at = argv.index("--rootfs")
        argv[at:at] = ["--log-driver", "passthrough"]
        self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE)
        self._pump(self._proc)
        return self.init_pid()

    def init_pid(self, wait_s: float = 20.0) -> int:
        deadline = time.monotonic() + wait_s
        while True:
            done = subprocess.run(["podman", "inspect", "--format", "{{.State.Pid}}",
                                   self.name], capture_output=True, text=True, check=False,
                                  timeout=30)
            if done.returncode == 0 and done.stdout.strip() not in ("", "0"):
                return int(done.stdout.strip())
            exited = self._proc is not None and self._proc.poll() is not None
            if exited or time.monotonic() > deadline:
                raise RuntimeError_(f"podman container {self.name}: no init pid after "
                                    f"{wait_s}s ({self._stderr_tail()})")
            time.sleep(0.05)

    def status(self) -> str:
        done = subprocess.run(["podman", "inspect", "--format", "{{.State.Status}}",
                               self.name], capture_output=True, text=True, check=False,
                              timeout=30)
        return done.stdout.strip() if done.returncode == 0 else "absent"

    def delete(self) -> None:
        subprocess.run(["podman", "rm", "--force", "--time", "0", self.name],
                       capture_output=True, check=False, timeout=60)
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
