"""Issue 24 (3): ghost files — files a job holds open or mapped after deleting them, such as
PyTorch's shared memory — are dumped up to ``ghost_limit`` (256 MiB by default, CRIU's own
1 MiB is too small for a DataLoader's batches); one over it refuses the dump in one line naming
the file, its size, the limit and the setting."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ckptd.adapters.criu.causes import explain
from ckptd.core.config import CoreConfig
from ckptd.daemon.config import GHOST_LIMIT_MAX, DaemonConfig, load

from .world import JOB, World

GHOST_LOG = (
    "(00.037678) Error (criu/files-reg.c:1031): Can't dump ghost file "
    "/dev/shm/torch_23521_2636518352_8 of 6291456 size, increase limit\n"
    "(00.037700) Error (criu/cr-dump.c:1440): Collect mappings (pid: 23294) failed with -1"
)


def test_a_ghost_file_over_the_limit_names_it_its_size_the_limit_and_the_setting(
    tmp_path: Path,
) -> None:
    cause = explain("dump of pid 23294", GHOST_LOG, 23294, tmp_path, ghost_limit=4 << 20)
    assert cause is not None
    assert cause.message.startswith("CRIU dump of pid 23294 failed: ")
    assert "/dev/shm/torch_23521_2636518352_8" in cause.message
    assert "6.0 MiB" in cause.message and "4.0 MiB" in cause.message
    assert "ghost_limit" in cause.message and "ghost_limit" in cause.hint
    assert "daemon's configuration" in cause.hint
    assert "increase limit" not in cause.message + cause.hint
    assert "\n" not in cause.message + cause.hint


def test_without_the_limit_known_the_setting_is_still_named(tmp_path: Path) -> None:
    cause = explain("dump of pid 5", GHOST_LOG, 5, tmp_path)
    assert cause is not None and "ghost_limit" in cause.message + cause.hint


def test_the_default_limit_covers_dataloader_batches_and_reaches_criu(world: World) -> None:
    assert CoreConfig.ghost_limit == DaemonConfig.ghost_limit == 256 << 20
    world.dump(JOB)
    assert world.criu.dump_jobs[-1].ghost_limit == 256 << 20


def _load(tmp_path: Path, setting: str) -> DaemonConfig:
    config = tmp_path / "ckptd.toml"
    config.write_text(setting + "\n")
    return load(argparse.Namespace(config=str(config), store=None, state_dir=None))


def test_ghost_limit_is_a_setting_within_what_criu_and_the_store_take(tmp_path: Path) -> None:
    assert _load(tmp_path, "ghost_limit = 1073741824").ghost_limit == 1 << 30
    assert _load(tmp_path, f"ghost_limit = {GHOST_LIMIT_MAX}").ghost_limit == GHOST_LIMIT_MAX
    for bad in ("-1", str(GHOST_LIMIT_MAX + 1), "1.5", "true", '"256M"'):
        with pytest.raises(ValueError, match=r"^ghost_limit .* must be a whole number of bytes"):
            _load(tmp_path, f"ghost_limit = {bad}")
