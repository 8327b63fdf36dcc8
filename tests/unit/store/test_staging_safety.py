"""Issue 33: what the store does in its staging directories as root — the start-up cleanup
never follows a link planted there (``ContentStore.clean`` is fd-relative) — and a dump's
ghost files count in the choice of RAM or disk staging, streamed or not (point 4)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.adapters.criu.images import is_pages_image
from ckptd.core.store import cas
from ckptd.core.store.cas import STREAM_STAGING_HINT, ContentStore, StagingPolicy
from ckptd.core.store.keys import ManifestKeys
from ckptd.domain import new_checkpoint_id
from ckptd.testing import FakeClock, MemoryBlobStore


def _store(fast: Path | None, disk: Path, *, stream_pages: bool = False) -> ContentStore:
    return ContentStore(MemoryBlobStore(), StagingPolicy(fast, disk, headroom=0),
                        clock=FakeClock(), is_pages_file=is_pages_image,
                        keys=ManifestKeys.generate(), stream_pages=stream_pages)


def _vault(tmp_path: Path) -> Path:
    vault = tmp_path / "vault"
    (vault / "tree").mkdir(parents=True)
    (vault / "tree" / "precious").write_bytes(b"precious\n")
    (vault / "top").write_bytes(b"top\n")
    return vault


def _intact(vault: Path) -> bool:
    return ((vault / "tree" / "precious").read_bytes() == b"precious\n"
            and (vault / "top").read_bytes() == b"top\n")


def test_clean_never_follows_a_link_planted_as_a_staging_root(tmp_path: Path) -> None:
    """A link where the fast staging should be (the old attack: a user's directory holding
    a link named as the daemon's): nothing behind it is removed."""
    vault = _vault(tmp_path)
    fast, disk = tmp_path / "fast", tmp_path / "disk"
    fast.symlink_to(vault)
    disk.mkdir()
    (disk / "ck-left").mkdir()
    removed = _store(fast, disk).clean()
    assert _intact(vault), "the cleanup followed a link to a root-only tree"
    assert removed == [str(disk / "ck-left")] and not (disk / "ck-left").exists()
    assert fast.is_symlink()


def test_clean_removes_links_in_a_staging_root_not_what_they_name(tmp_path: Path) -> None:
    vault = _vault(tmp_path)
    disk = tmp_path / "disk"
    (disk / "ck-a" / "images").mkdir(parents=True)
    (disk / "ck-a" / "images" / "into").symlink_to(vault)
    (disk / "link").symlink_to(vault)
    (disk / "file").write_bytes(b"x")
    removed = _store(None, disk).clean()
    assert _intact(vault)
    assert sorted(removed) == sorted(str(disk / n) for n in ("ck-a", "link", "file"))
    assert list(disk.iterdir()) == []


def test_ghost_bytes_count_in_the_choice_of_ram_or_disk_streamed_or_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The RAM staging has 1 GiB free: a streamed dump's non-page images (at most
    STREAM_STAGING_HINT) fit there, not with 1 GiB of ghost files on top (they are not
    pages: staged whole)."""
    fast, disk = tmp_path / "fast", tmp_path / "disk"
    monkeypatch.setattr(cas, "_statvfs", lambda path: 1 << 30)
    for stream_pages in (True, False):
        store = _store(fast, disk, stream_pages=stream_pages)
        rss = (8 << 30) if stream_pages else (256 << 20)
        small = store.begin(new_checkpoint_id(1.0), rss)
        assert small.parent.parent == fast, stream_pages
        ghosts = store.begin(new_checkpoint_id(2.0), rss, ghost_bytes=1 << 30)
        assert ghosts.parent.parent == disk, stream_pages
    assert STREAM_STAGING_HINT * 5 // 4 < 1 << 30
