"""A job that tries to create an io_uring instance, then counts (used by several test tiers).

Usage: uring_job.py [--keep fd|mapped] [--steps N] [--period S]

It calls ``io_uring_setup(8, params)`` (syscall 425) through ctypes and prints one line,
``io_uring_setup: fd`` or ``io_uring_setup: <ERRNO NAME>`` (ENOSYS under ``ckptctl run``'s
filter). With ``--keep mapped`` it maps the submission ring and closes the fd (the instance
lives on in the mapping). Then it prints ``step I X`` (X a deterministic sequence) every
PERIOD seconds, STEPS times (0: for ever), and ``done STEPS``: an interrupted and restored run
prints exactly the lines of an uninterrupted one.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import mmap
import os
import struct
import time

IO_URING_SETUP = 425
PARAMS_SIZE = 120  # struct io_uring_params
SQ_OFF_ARRAY = 64  # offsetof(struct io_uring_params, sq_off.array)


def setup(keep: str) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(PARAMS_SIZE)
    fd = libc.syscall(IO_URING_SETUP, 8, params)
    if fd < 0:
        code = ctypes.get_errno()
        print(f"io_uring_setup: {errno.errorcode.get(code, str(code))}", flush=True)
        return fd
    print("io_uring_setup: fd", flush=True)
    if keep != "mapped":
        return fd
    (entries,) = struct.unpack_from("I", params.raw, 0)
    (array,) = struct.unpack_from("I", params.raw, SQ_OFF_ARRAY)
    libc.mmap.restype = ctypes.c_void_p  # not Python's mmap: it keeps a dup of the fd
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    ring = libc.mmap(None, array + entries * 4, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_SHARED, fd, 0)
    if ring in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap of the submission ring")
    os.close(fd)
    return -1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keep", choices=("fd", "mapped"), default="fd")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--period", type=float, default=0.03)
    args = parser.parse_args()
    setup(args.keep)
    x, i = 1, 0
    while args.steps == 0 or i < args.steps:
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        print(f"step {i} {x}", flush=True)
        i += 1
        time.sleep(args.period)
    print(f"done {i}", flush=True)


if __name__ == "__main__":
    main()
