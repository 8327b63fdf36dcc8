"""``PipeFeeder``: verified bytes spliced into a real pipe (vmsplice), each chunk referenced
until the reader has read past it; mutable buffers copied; the reader gets exactly what was
fed, in order."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import pytest

from ckptd.adapters.criu.pipefeed import PipeFeeder, Stopped, spliceable


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
    assert feeder.spliced == sum(len(c) for c in chunks)  # all bytes-backed: spliced


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


def test_finish_waits_until_the_reader_has_read_everything(pipe: tuple[int, int]) -> None:
    """Spliced pages are the feeder's memory: it lets them go only once read."""
    r, w = pipe
    got = bytearray()
    read_at: list[float] = []
    feeder = PipeFeeder(w, threading.Event())
    feeder.feed(memoryview(os.urandom(32768)))  # fits the pipe: fed at once, not yet read
    reader = _read_all(r, got, delay=0.3, done=read_at)
    started = time.monotonic()
    waiter = threading.Thread(target=feeder.finish)
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive()  # nothing read yet: still holding its chunk
    waiter.join(10)
    finished = time.monotonic()
    os.close(w)
    reader.join(10)
    assert len(got) == 32768
    assert finished - started >= 0.3


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
        feeder.feed(memoryview(os.urandom(65536)))
