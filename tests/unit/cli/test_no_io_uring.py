"""The seccomp filter ``ckptctl run`` puts on jobs: its program (interpreted here, on every
architecture it knows), and the real filter on real children (x86_64 and aarch64)."""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckptd.transport.cli import no_io_uring as nu

URING_JOB = Path(__file__).resolve().parents[2] / "uring_job.py"
ENOSYS = nu.SECCOMP_RET_ERRNO | errno.ENOSYS
ARCHES = {"x86_64": nu.AUDIT_ARCH_X86_64, "i386": nu.AUDIT_ARCH_I386,
          "aarch64": nu.AUDIT_ARCH_AARCH64, "arm": nu.AUDIT_ARCH_ARM}
RISCV64 = 0xC00000F3


def run_program(arch: int, nr: int) -> int:
    """What the classic BPF program returns for one call (the opcodes it uses only)."""
    insns = nu.program()
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == nu.BPF_LD_W_ABS:
            acc = {nu.NR_OFFSET: nr & 0xFFFFFFFF, nu.ARCH_OFFSET: arch}[k]
        elif code == nu.BPF_ALU_AND_K:
            acc &= k
        elif code == nu.BPF_JMP_JA:
            pc += k
        elif code in (nu.BPF_JMP_JEQ_K, nu.BPF_JMP_JGE_K, nu.BPF_JMP_JGT_K):
            taken = {nu.BPF_JMP_JEQ_K: acc == k, nu.BPF_JMP_JGE_K: acc >= k,
                     nu.BPF_JMP_JGT_K: acc > k}[code]
            pc += jt if taken else jf
        else:
            assert code == nu.BPF_RET_K, f"unexpected opcode {code:#x}"
            return k


@pytest.mark.parametrize("arch", sorted(ARCHES))
def test_the_io_uring_calls_get_enosys_and_nothing_else_does(arch: str) -> None:
    audit = ARCHES[arch]
    for nr in nu.IO_URING_SYSCALLS:
        assert run_program(audit, nr) == ENOSYS, nr
    for nr in (0, 1, 39, 59, 172, 231, 424, 428, 435, 0xFFFFFFFF):
        assert run_program(audit, nr) == nu.SECCOMP_RET_ALLOW, nr


def test_x32_calls_are_filtered_and_other_architectures_are_not() -> None:
    x32 = nu.X32_SYSCALL_BIT
    assert run_program(nu.AUDIT_ARCH_X86_64, x32 | 425) == ENOSYS
    assert run_program(nu.AUDIT_ARCH_X86_64, x32 | 1) == nu.SECCOMP_RET_ALLOW
    assert run_program(nu.AUDIT_ARCH_AARCH64, x32 | 425) == nu.SECCOMP_RET_ALLOW
    assert run_program(RISCV64, 425) == nu.SECCOMP_RET_ALLOW


def test_the_program_reads_only_the_architecture_and_the_call_number() -> None:
    """So the kernel's seccomp cache finds every other call constantly allowed: they do not
    run the filter at all (see docs/adr/0009)."""
    loads = {k for code, _jt, _jf, k in nu.program() if code == nu.BPF_LD_W_ABS}
    assert loads == {nu.NR_OFFSET, nu.ARCH_OFFSET}


def test_an_unknown_machine_gets_no_filter_and_one_line_saying_so(
    capfd: pytest.CaptureFixture[str],
) -> None:
    assert nu.preexec("riscv64") is None
    out, err = capfd.readouterr()
    assert out == ""
    assert err == ("ckptctl run: io_uring is not kept away from jobs on riscv64 (only on "
                   "aarch64 and x86_64): the job cannot be checkpointed if it uses io_uring\n")
    assert nu.supported("x86_64") and nu.supported("aarch64")


needs_filter = pytest.mark.skipif(not nu.supported(), reason="the filter is for x86_64, aarch64")

CHILD = textwrap.dedent("""
    import ctypes, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    def call(nr, *args):
        ret = libc.syscall(nr, *args)
        return "ok" if ret >= 0 else os.strerror(ctypes.get_errno())
    params = ctypes.create_string_buffer(120)
    print("setup", call(425, 8, params))
    print("enter", call(426, 0, 0, 0, 0, 0, 0))
    print("register", call(427, 0, 0, 0, 0))
    print("getpid", call(39 if os.uname().machine == "x86_64" else 172) )
    with open("/proc/self/status") as f:
        print("seccomp", [l.split()[1] for l in f if l.startswith("Seccomp:")][0])
    os.write(1, b"write ok\\n")
    sys.stdout.flush()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, sys.argv[1], "--steps", "1", "--period", "0"])
    print("grandchild", os.waitstatus_to_exitcode(os.wait()[1]))
""")


@needs_filter
def test_a_child_under_the_filter_gets_enosys_for_io_uring_only_and_passes_it_on() -> None:
    # through the exec wrapper ``ckptctl run`` uses (no preexec_fn: this process has threads)
    out = subprocess.run(
        nu.launcher([sys.executable, "-c", CHILD, str(URING_JOB)]),
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.splitlines()
    assert out == [
        "setup Function not implemented",
        "enter Function not implemented",
        "register Function not implemented",
        "getpid ok",
        "seccomp 2",
        "write ok",
        "io_uring_setup: ENOSYS",  # the grandchild, after fork and exec
        "step 0 7806831264735756412",
        "done 1",
        "grandchild 0",
    ]


@needs_filter
def test_without_the_filter_the_same_child_may_use_io_uring() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD, str(URING_JOB)], capture_output=True,
                         text=True, timeout=60, check=True).stdout.splitlines()
    ours = next(ln.split()[1] for ln in Path("/proc/self/status").read_text().splitlines()
                if ln.startswith("Seccomp:"))
    assert f"seccomp {ours}" in out
    if out[0] == "setup ok":  # else io_uring is off on this node (sysctl, a container's filter)
        assert "io_uring_setup: fd" in out


@needs_filter
def test_a_filter_that_cannot_be_installed_says_so_and_the_job_runs() -> None:
    # In a fresh interpreter: this test process may hold grpc's threads (other tests), whose
    # fork handlers can log into the child's stderr, which is what is compared here.
    script = ("import subprocess, sys\n"
              "from ckptd.transport.cli import no_io_uring as nu\n"
              "broken = nu.Filter(())  # an empty program: the kernel answers EINVAL\n"
              "sys.exit(subprocess.run(['true'], preexec_fn=broken.install).returncode)\n")
    res = subprocess.run([sys.executable, "-c", script],
                         capture_output=True, text=True, timeout=30, check=False)
    assert res.returncode == 0
    assert res.stderr == ("ckptctl run: cannot keep io_uring away from the job (seccomp: "
                          "Invalid argument); it cannot be checkpointed if it uses io_uring\n")


def test_the_wrapper_says_when_the_command_cannot_start() -> None:
    res = subprocess.run(nu.launcher(["/nonexistent/train"]), capture_output=True, text=True,
                         timeout=30, check=False)
    assert res.returncode == 127
    assert res.stderr == "ckptctl: cannot start /nonexistent/train: No such file or directory\n"
