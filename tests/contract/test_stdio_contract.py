"""Contract of ``StdioProvider``: ``LocalStdioProvider`` and ``FakeStdioProvider`` behave the
same (see core/ports/): one descriptor per distinct external key, open inside the context and
closed when it exits, none for stdio the tree owns; ``from_process`` of a gone process raises
ProcessNotFound.

Implementations are listed in ``PROVIDERS``; each harness gives a live process whose stdio can
be reopened and a pid that is free."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ckptd.adapters.procfs.stdio import LocalStdioProvider
from ckptd.core.ports import StdioProvider
from ckptd.domain import StdioFact, StdioKind
from ckptd.errors import ProcessNotFound
from ckptd.testing import FakeStdioProvider


@dataclass
class StdioHarness:
    provider: StdioProvider
    live: int
    gone: int
    ends: list[Callable[[], None]] = field(default_factory=list)


def _free_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait(10)
    return proc.pid


def _local(tmp: Path) -> StdioHarness:
    out = open(tmp / "live.out", "wb")  # noqa: SIM115 (closed with the harness)
    proc = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL, stdout=out,
                            stderr=out)
    harness = StdioHarness(LocalStdioProvider(5.0), proc.pid, _free_pid())

    def end() -> None:
        proc.kill()
        proc.wait(10)
        out.close()

    harness.ends.append(end)
    return harness


def _fake(tmp: Path) -> StdioHarness:
    provider = FakeStdioProvider()
    provider.gone.add(99999)
    return StdioHarness(provider, 4242, 99999)


PROVIDERS: dict[str, Callable[[Path], StdioHarness]] = {"local": _local, "fake": _fake}


@pytest.fixture(params=sorted(PROVIDERS))
def h(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StdioHarness]:
    harness = PROVIDERS[request.param](tmp_path)
    try:
        yield harness
    finally:
        for end in harness.ends:
            end()


STDIO = (
    StdioFact(10, 0, StdioKind.PIPE, "pipe:[1]", False, "pipe:[1]"),
    StdioFact(10, 1, StdioKind.PIPE, "pipe:[2]", True, "pipe:[2]"),
    StdioFact(10, 2, StdioKind.PIPE, "pipe:[2]", True, "pipe:[2]"),  # same pipe: one fd
    StdioFact(11, 1, StdioKind.FILE, "/var/log/x", True),  # CRIU reopens it itself
)


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_one_open_descriptor_per_external_key_closed_on_exit(
    h: StdioHarness, tmp_path: Path,
) -> None:
    with h.provider.replacements(STDIO, tmp_path / "restore.out") as fds:
        assert sorted(f.key for f in fds) == ["pipe:[1]", "pipe:[2]"]
        assert len({f.fd for f in fds}) == 2 and all(_open(f.fd) for f in fds)
    assert not any(_open(f.fd) for f in fds)


def test_stdio_the_tree_owns_needs_nothing(h: StdioHarness, tmp_path: Path) -> None:
    with h.provider.replacements(STDIO[3:], tmp_path / "restore.out") as fds:
        assert fds == ()


def test_descriptors_are_closed_when_the_body_raises(h: StdioHarness, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), \
            h.provider.replacements(STDIO, tmp_path / "restore.out") as fds:
        raise RuntimeError("CRIU failed")
    assert not any(_open(f.fd) for f in fds)


def test_from_a_live_process(h: StdioHarness) -> None:
    with h.provider.from_process(STDIO, h.live) as fds:
        assert sorted(f.key for f in fds) == ["pipe:[1]", "pipe:[2]"]
        assert all(_open(f.fd) for f in fds)
    assert not any(_open(f.fd) for f in fds)


def test_from_a_gone_process_raises(h: StdioHarness) -> None:
    with pytest.raises(ProcessNotFound), h.provider.from_process(STDIO, h.gone):
        pass
