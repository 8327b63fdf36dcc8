"""``PipeFeeder``: verified bytes spliced into a real pipe (vmsplice), each chunk referenced
until the reader has read past it; mutable buffers copied; the reader gets exactly what was
fed, in order."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator

import pytest

from ckptd.adapters.criu.pipefeed import F_GETPIPE_SZ, PipeFeeder, Stopped, spliceable


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe2(os.O_CLOEXEC)
    os.set_blocking(w, False)
    try:
        yield r, w
    finally:
        for fd in (r, w):
            with contextlib.suppress(OSError):
                os.close(fd)


def _read_all(fd: int, into: bytearray, delay: float = 0.0, done: list[float] | None = None
              ) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        while chunk := os.read(fd, 1 << 16):
            into.extend(chunk)
        if done is not None:
            done.append(time.monotonic())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_reader_gets_exactly_what_was_fed(pipe: tuple[int, int]) -> None:
    r, w = pipe
    frames = [os.urandom(4 << 20) for _ in range(3)]
    chunks = [memoryview(frames[0]), memoryview(frames[1])[4096:1 << 20],
              memoryview(bytes(3 << 20)), memoryview(frames[2])[: 8192]]
    got = bytearray()
    reader = _read_all(r, got)
    feeder = PipeFeeder(w, threading.Event())
    for chunk in chunks:
        feeder.feed(chunk)
    feeder.finish()
    os.close(w)
    reader.join(10)
    assert bytes(got) == b"".join(bytes(c) for c in chunks)
    # spliced: each chunk a pipe's size (64 KiB here) of bytes follows; the tail is copied
    assert feeder.spliced == len(chunks[0]) + len(chunks[1])


def test_a_mutable_buffer_is_copied_not_spliced(pipe: tuple[int, int]) -> None:
    """A reused bytearray (DirectoryImages' read buffer) changes after it is fed: what the
    reader gets is what it held when fed."""
    r, w = pipe
    buf = bytearray(b"a" * 16384)
    assert not spliceable(memoryview(buf))
    feeder = PipeFeeder(w, threading.Event())
    feeder.feed(memoryview(buf))
    buf[:] = b"b" * 16384  # before anyone reads (both fit the pipe)
    feeder.feed(memoryview(buf))
    got = bytearray()
    reader = _read_all(r, got)
    feeder.finish()
    os.close(w)
    reader.join(10)
    assert bytes(got) == b"a" * 16384 + b"b" * 16384
    assert feeder.spliced == 0


def test_after_finish_nothing_spliced_is_left_in_the_pipe(pipe: tuple[int, int]) -> None:
    """The image's last pipe-size bytes are copied: once they are in the pipe, no spliced page
    can be, so finish lets every chunk go without waiting for the reader."""
    r, w = pipe
    size = fcntl.fcntl(w, F_GETPIPE_SZ)
    got = bytearray()
    reader = _read_all(r, got, delay=0.2)  # slow: finish must not depend on it
    feeder = PipeFeeder(w, threading.Event())
    data = [os.urandom(size) for _ in range(6)]
    for chunk in data:
        feeder.feed(memoryview(chunk))
    feeder.finish()
    assert feeder.unreleased() == []
    assert feeder.spliced == 5 * size  # all but the last pipe's size
    os.close(w)
    reader.join(10)
    assert bytes(got) == b"".join(data)


def test_a_failed_feeder_hands_back_what_the_pipe_may_still_hold(pipe: tuple[int, int]) -> None:
    r, w = pipe
    size = fcntl.fcntl(w, F_GETPIPE_SZ)
    feeder = PipeFeeder(w, threading.Event())
    first, second = memoryview(os.urandom(size // 2)), memoryview(os.urandom(size))
    feeder.feed(first)
    feeder.feed(second)  # first is now spliced (a pipe's size follows it), nobody has read
    assert feeder.spliced == len(first)
    kept = feeder.unreleased()  # a damaged frame comes next: the caller keeps these
    assert kept == [first]
    assert os.read(r, len(first)) == bytes(first)


def test_stopping_ends_a_wait_on_a_pipe_nobody_reads(pipe: tuple[int, int]) -> None:
    _r, w = pipe
    stopping = threading.Event()
    feeder = PipeFeeder(w, stopping)
    threading.Timer(0.3, stopping.set).start()
    with pytest.raises(Stopped):
        for _ in range(64):  # far more than the pipe holds
            feeder.feed(memoryview(os.urandom(1 << 20)))


def test_a_reader_gone_is_a_broken_pipe(pipe: tuple[int, int]) -> None:
    r, w = pipe
    os.close(r)
    feeder = PipeFeeder(w, threading.Event())
    with pytest.raises(BrokenPipeError):
        feeder.feed(memoryview(os.urandom(1 << 20)))
        feeder.feed(memoryview(os.urandom(1 << 20)))  # the first is spliced now
        feeder.finish()
