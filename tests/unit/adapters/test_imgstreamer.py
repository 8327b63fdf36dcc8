"""The image-streamer protocol (``adapters.criu.imgstreamer``) against a fake CRIU that speaks
it as ``criu/img-streamer.c`` does: u32-framed protobuf requests and replies on a stream
socket, the pipe's write end sent with one byte and SCM_RIGHTS, the image read from the pipe."""

from __future__ import annotations

import array
import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd._gen.criu import img_streamer_pb2
from ckptd.adapters.criu.imgstreamer import (
    SOCKET_NAME,
    ImageStreamer,
    StreamGuard,
    StreamProtocolError,
    encode_message,
    read_request,
)
from ckptd.core.ports import CriuHooks
from ckptd.core.store.restream import DirectoryImages
from ckptd.errors import CorruptCheckpoint


class FakeCriu:
    """The restore side of CRIU's image streamer (img_streamer_open, O_RSTR)."""

    def __init__(self, images_dir: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(images_dir / SOCKET_NAME))

    def request(self, name: str) -> bool:
        self.sock.sendall(encode_message(
            img_streamer_pb2.img_streamer_request_entry(filename=name)))
        (size,) = struct.unpack("=I", _exactly(self.sock, 4))
        reply = img_streamer_pb2.img_streamer_reply_entry()
        reply.ParseFromString(_exactly(self.sock, size))
        return reply.exists

    def open(self, name: str) -> int | None:
        """The read end of the image's pipe; None if the streamer says it does not exist."""
        if not self.request(name):
            return None
        read_end, write_end = os.pipe()
        self.sock.sendmsg([b"\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                     array.array("i", [write_end]).tobytes())])
        os.close(write_end)
        return read_end

    def read(self, name: str) -> bytes | None:
        fd = self.open(name)
        if fd is None:
            return None
        chunks = []
        try:
            while data := os.read(fd, 1 << 16):
                chunks.append(data)
        finally:
            os.close(fd)
        return b"".join(chunks)

    def close(self) -> None:
        self.sock.close()


def _exactly(sock: socket.socket, size: int) -> bytes:
    buf = b""
    while len(buf) < size:
        part = sock.recv(size - len(buf))
        assert part, "the streamer closed the connection"
        buf += part
    return buf


@pytest.fixture
def image_dir(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "inventory.img").write_bytes(b"inventory")
    (src / "pages-1.img").write_bytes(os.urandom(3 << 20) + bytes(8192))
    (src / "empty.img").write_bytes(b"")
    return src


def _serve(tmp_path: Path, source: object) -> tuple[ImageStreamer, Path]:
    empty = tmp_path / "empty"
    empty.mkdir()
    streamer = ImageStreamer(empty, source)  # type: ignore[arg-type]
    streamer.start()
    return streamer, empty


def test_images_are_served_whole_and_absent_ones_said_absent(
    tmp_path: Path, image_dir: Path
) -> None:
    streamer, empty = _serve(tmp_path, DirectoryImages(image_dir, "ck-1"))
    assert (empty / SOCKET_NAME).stat().st_mode & 0o777 == 0o600
    criu = FakeCriu(empty)
    try:
        for name in ("inventory.img", "pages-1.img", "empty.img", "inventory.img"):
            assert criu.read(name) == (image_dir / name).read_bytes(), name
        assert criu.read("core-9.img") is None
        # two images open at once, read in the other order (a writer thread per pipe)
        first, second = criu.open("pages-1.img"), criu.open("inventory.img")
        assert first is not None and second is not None
        assert os.read(second, 100) == b"inventory"
        os.close(second)
        os.close(first)  # CRIU stops reading early: not an error of the streamer
    finally:
        criu.close()
        streamer.close()
    assert streamer.error is None
    assert streamer.served == ["inventory.img", "pages-1.img", "empty.img", "inventory.img",
                               "pages-1.img", "inventory.img"]
    assert streamer.missing == ["core-9.img"]
    assert not (empty / SOCKET_NAME).exists()


class _Failing(DirectoryImages):
    """Gives the first MiB of an image, then fails as a damaged frame does."""

    def chunks(self, name: str) -> Iterator[memoryview]:
        for i, chunk in enumerate(super().chunks(name)):
            if i == 1:
                raise CorruptCheckpoint(f"checkpoint {self.checkpoint_id}: pack p0 frame 1 "
                                        "page 3: content does not match its hash")
            yield chunk


def test_a_source_failure_is_recorded_before_the_pipe_ends_short(
    tmp_path: Path, image_dir: Path
) -> None:
    streamer, empty = _serve(tmp_path, _Failing(image_dir, "ck-2"))
    criu = FakeCriu(empty)
    try:
        data = criu.read("pages-1.img")
        # CRIU meets EOF early; by then the error is there for its next notification
        assert data is not None and len(data) == 1 << 20
        error = streamer.error
        assert isinstance(error, CorruptCheckpoint)
        assert "ck-2" in error.message and "pack p0 frame 1" in error.message
        assert criu.read("inventory.img") == b"inventory"  # other images still served
        guard = StreamGuard(CriuHooks(), streamer)
        guard.pre_restore(1)  # before the tree exists: CRIU fails on its own
        for notification in (guard.post_restore, guard.pre_resume):  # CRIU then kills it
            with pytest.raises(CorruptCheckpoint, match="pack p0 frame 1"):
                notification(1)
    finally:
        criu.close()
        streamer.close()


def test_a_request_that_breaks_the_protocol_fails_the_streamer(tmp_path: Path,
                                                               image_dir: Path) -> None:
    streamer, empty = _serve(tmp_path, DirectoryImages(image_dir, "ck-3"))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(empty / SOCKET_NAME))
    sock.sendall(struct.pack("=I", 1 << 30))  # a request of 1 GiB
    assert sock.recv(1) == b""  # the streamer hangs up
    sock.close()
    streamer.close()
    error = streamer.error
    assert error is not None and "ck-3" in error.message and "request of" in error.message


def test_framing_of_requests() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(encode_message(
            img_streamer_pb2.img_streamer_request_entry(filename="pstree.img")))
        theirs.sendall(struct.pack("=I", 3) + b"\x0a\x05a")  # a string cut short
        theirs.sendall(struct.pack("=I", 0))  # no file name
        theirs.sendall(struct.pack("=I", 12) + b"\x0a\x0apa")  # the connection cut short
        assert read_request(ours) == "pstree.img"
        with pytest.raises(StreamProtocolError, match="does not parse"):
            read_request(ours)
        with pytest.raises(StreamProtocolError, match="without a file name"):
            read_request(ours)
        theirs.shutdown(socket.SHUT_WR)
        with pytest.raises(StreamProtocolError, match="closed 4 bytes into 12"):
            read_request(ours)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.shutdown(socket.SHUT_WR)
        assert read_request(ours) is None  # CRIU is done: a clean end


def test_close_before_criu_connects(tmp_path: Path, image_dir: Path) -> None:
    streamer, empty = _serve(tmp_path, DirectoryImages(image_dir))
    streamer.close()
    streamer.close()  # idempotent
    assert streamer.error is None
    assert not (empty / SOCKET_NAME).exists()


def test_close_ends_a_writer_whose_pipe_is_never_read(tmp_path: Path, image_dir: Path) -> None:
    """A pipe still open but never read (whoever holds its read end will not read): ``close``
    does not wait for it."""
    streamer, empty = _serve(tmp_path, DirectoryImages(image_dir, "ck-4"))
    criu = FakeCriu(empty)
    fd = criu.open("pages-1.img")  # 3 MiB: more than the pipe holds
    assert fd is not None
    try:
        time.sleep(0.3)
        started = time.monotonic()
        streamer.close(timeout=10)
        assert time.monotonic() - started < 2
        assert streamer.error is None
    finally:
        os.close(fd)
        criu.close()
