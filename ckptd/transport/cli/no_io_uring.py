"""Keep io_uring away from the jobs ``ckptctl run`` launches: a seccomp filter.

CRIU cannot checkpoint a process that holds an io_uring instance (``Unknown shit 600
(anon_inode:[io_uring])``), and libraries create one behind the application's back: libuv
(PyTorch's TCPStore) does in the torchrun agent and in rank 0. So the launcher installs, in the
job's process just before it execs, a seccomp filter under which ``io_uring_setup``,
``io_uring_enter`` and ``io_uring_register`` fail with ENOSYS — what a kernel without io_uring
answers, on which libuv, liburing users and others fall back to epoll or plain syscalls. Every
other system call is allowed. A seccomp filter cannot be removed and is inherited by every
descendant (fork, clone, exec), and CRIU checkpoints and restores it with the job, so the whole
job, restored or not, never gets an io_uring. Why this and not the kernel's
``kernel.io_uring_disabled`` sysctl, with measurements: docs/adr/0009.

The filter is a classic BPF program built here (no dependency). It checks the audit
architecture of each call: x86_64 (x32 calls too, whose numbers carry bit 30), i386, aarch64
and 32-bit arm, where the three calls are 425, 426 and 427; calls of any other architecture are
allowed. It depends only on the architecture and the call number, so the kernel (5.11 and
later) finds every other call constantly allowed and caches that: they do not run the filter.
It is installed only when this machine is x86_64 or aarch64 (``supported``).

The filter is a compatibility measure, not a sandbox: the job is as trusted as without it. So
``PR_SET_NO_NEW_PRIVS`` is set only when the kernel requires it (a launcher without
CAP_SYS_ADMIN; it stops set-uid programs in the job from gaining privileges), and the filter is
loaded with ``SECCOMP_FILTER_FLAG_SPEC_ALLOW``: a kernel booted with
``spec_store_bypass_disable=seccomp`` or ``spectre_v2_user=seccomp`` (the default before 5.16)
would otherwise turn on speculation mitigations for the job, which slow compute.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
from collections.abc import Callable

IO_URING_SYSCALLS = (425, 426, 427)
"""io_uring_setup, io_uring_enter, io_uring_register: the same numbers on every architecture
the filter knows."""

SYS_SECCOMP = {"x86_64": 317, "aarch64": 277}
MACHINES = frozenset(SYS_SECCOMP)
"""Machines (``uname -m``) on which the filter is installed."""

# <linux/audit.h>
AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_I386 = 0x40000003
AUDIT_ARCH_AARCH64 = 0xC00000B7
AUDIT_ARCH_ARM = 0x40000028
X32_SYSCALL_BIT = 0x40000000

# <linux/filter.h>, <linux/bpf_common.h>
BPF_LD_W_ABS = 0x20
BPF_ALU_AND_K = 0x54
BPF_JMP_JA = 0x05
BPF_JMP_JEQ_K = 0x15
BPF_JMP_JGT_K = 0x25
BPF_JMP_JGE_K = 0x35
BPF_RET_K = 0x06

# <linux/seccomp.h>, <linux/prctl.h>
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_SPEC_ALLOW = 1 << 2
PR_SET_NO_NEW_PRIVS = 38
NR_OFFSET = 0  # offsetof(struct seccomp_data, nr)
ARCH_OFFSET = 4  # offsetof(struct seccomp_data, arch)

Insn = tuple[int, int, int, int]
"""One classic BPF instruction: (code, jt, jf, k); jumps are relative to the next one."""


def program() -> tuple[Insn, ...]:
    """The filter: ENOSYS for the io_uring calls of the known architectures, allow the rest."""
    first, last = IO_URING_SYSCALLS[0], IO_URING_SYSCALLS[-1]
    return (
        (BPF_LD_W_ABS, 0, 0, ARCH_OFFSET),  # 0  A = arch
        (BPF_JMP_JEQ_K, 0, 3, AUDIT_ARCH_X86_64),  # 1  x86_64: 2, else 5
        (BPF_LD_W_ABS, 0, 0, NR_OFFSET),  # 2  A = nr
        (BPF_ALU_AND_K, 0, 0, ~X32_SYSCALL_BIT & 0xFFFFFFFF),  # 3  x32 calls: same numbers
        (BPF_JMP_JA, 0, 0, 4),  # 4  -> 9
        (BPF_JMP_JEQ_K, 2, 0, AUDIT_ARCH_I386),  # 5  -> 8
        (BPF_JMP_JEQ_K, 1, 0, AUDIT_ARCH_AARCH64),  # 6  -> 8
        (BPF_JMP_JEQ_K, 0, 4, AUDIT_ARCH_ARM),  # 7  other architectures: -> 12
        (BPF_LD_W_ABS, 0, 0, NR_OFFSET),  # 8  A = nr
        (BPF_JMP_JGE_K, 0, 2, first),  # 9  below: -> 12
        (BPF_JMP_JGT_K, 1, 0, last),  # 10 above: -> 12
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.ENOSYS),  # 11
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),  # 12
    )


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def supported(machine: str | None = None) -> bool:
    """Whether the filter is installed on ``machine`` (default: this one)."""
    return (machine or platform.machine()) in MACHINES


class Filter:
    """The filter, prepared in the launcher, installed by ``install`` in the child between
    fork and exec (``Popen(preexec_fn=filter.install)``): everything that allocates or loads
    is done here, so the child only makes a few system calls through ctypes."""

    def __init__(self, insns: tuple[Insn, ...] | None = None, machine: str | None = None
                 ) -> None:
        insns = program() if insns is None else insns
        self._insns = (_SockFilter * len(insns))(*(_SockFilter(*i) for i in insns))
        self._fprog = _SockFprog(len(insns), self._insns)
        self._address = ctypes.c_void_p(ctypes.addressof(self._fprog))
        self._nr = ctypes.c_long(SYS_SECCOMP[machine or platform.machine()])
        libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = libc.syscall
        self._prctl = libc.prctl
        self._prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                                ctypes.c_ulong]
        self._prctl.restype = ctypes.c_int
        self._flags = (ctypes.c_long(SECCOMP_FILTER_FLAG_SPEC_ALLOW), ctypes.c_long(0))
        self._op = ctypes.c_long(SECCOMP_SET_MODE_FILTER)

    def _load(self) -> int:
        """seccomp(SECCOMP_SET_MODE_FILTER): 0, or its errno."""
        err = 0
        for flags in self._flags:  # SPEC_ALLOW is unknown before Linux 4.17: EINVAL
            if self._syscall(self._nr, self._op, flags, self._address) == 0:
                return 0
            err = ctypes.get_errno()
            if err != errno.EINVAL:
                break
        return err

    def install(self) -> None:
        """Install the filter on the calling thread (and so on whatever it execs and forks).
        Never raises: on failure it writes one line to stderr and the job runs without the
        filter (a dump then refuses it if it uses io_uring)."""
        err = self._load()
        if err == errno.EACCES:  # no CAP_SYS_ADMIN: the kernel requires no_new_privs
            if self._prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0:
                err = self._load()
            else:
                err = ctypes.get_errno()
        if err == 0:
            return
        os.write(2, f"ckptctl run: cannot keep io_uring away from the job (seccomp: "
                    f"{os.strerror(err)}); it cannot be checkpointed if it uses "
                    "io_uring\n".encode())


def preexec(machine: str | None = None) -> Callable[[], None] | None:
    """What ``ckptctl run`` gives ``Popen`` as ``preexec_fn``: the filter's ``install``, or
    None on a machine it does not know, after saying so once on stderr."""
    machine = machine or platform.machine()
    if not supported(machine):
        os.write(2, f"ckptctl run: io_uring is not kept away from jobs on {machine} (only "
                    f"on {' and '.join(sorted(MACHINES))}): the job cannot be checkpointed if "
                    "it uses io_uring\n".encode())
        return None
    return Filter(machine=machine).install


def launcher(command: list[str], machine: str | None = None) -> list[str]:
    """The argv ``ckptctl run`` starts: ``command`` behind a tiny exec wrapper (this module
    run with ``python -m``) that installs the filter and execs it — same pid, no
    ``preexec_fn``: forking a process with gRPC's threads about to run Python in the child is
    what ``preexec_fn`` cannot do safely (a fork handler may abort). ``command`` as is on a
    machine the filter does not know, after saying so once on stderr."""
    if preexec(machine) is None:
        return command
    return [sys.executable, "-m", __name__, "--", *command]


def main(argv: list[str]) -> int:
    """``python -m ckptd.transport.cli.no_io_uring -- CMD ...``: filter, then exec CMD."""
    command = argv[1:] if argv[:1] == ["--"] else argv
    if not command:
        os.write(2, b"usage: python -m ckptd.transport.cli.no_io_uring -- CMD ...\n")
        return 2
    Filter().install()
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        os.write(2, f"ckptctl: cannot start {command[0]}: {exc.strerror}\n".encode())
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
