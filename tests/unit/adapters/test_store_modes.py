"""Who can read the store and the manifest keys: the store's objects and directories are
private to root whatever existed before (a store directory left 0755, objects an older ckptd
wrote 0644), and the manifest key file is created 0600, tightened if loosened, refused if it
is not root's own or holds no key."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.adapters.storage import LocalBlobStore, keyfile
from ckptd.core.store.keys import ManifestKeys, key_id


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.mark.usefixtures("umask_022")
def test_a_store_directory_that_existed_0755_is_made_private(tmp_path: Path) -> None:
    root = tmp_path / "store"
    (root / "packs" / "ab").mkdir(parents=True)
    root.chmod(0o755)
    (root / "packs").chmod(0o755)
    (root / "store.json").write_text('{"format": 1, "secret": "00"}')
    (root / "store.json").chmod(0o644)
    LocalBlobStore(root)
    assert mode(root) == 0o700
    assert mode(root / "store.json") == 0o600
    assert mode(root / "packs") == 0o700


@pytest.mark.usefixtures("umask_022")
def test_objects_and_their_directories_are_created_private(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir(mode=0o755)
    blobs = LocalBlobStore(root)
    blobs.put("store.json", b"{}", if_absent=True)
    blobs.put("packs/ab/abcdef", b"pack")
    blobs.put_parts("blobs/cd/cdef", [b"a", b"b"])
    for key in ("store.json", "packs/ab/abcdef", "blobs/cd/cdef"):
        assert mode(root / key) == 0o600, key
    for sub in ("packs", "packs/ab", "blobs", "blobs/cd"):
        assert mode(root / sub) == 0o700, sub


def test_the_content_store_keeps_its_secret_private(tmp_path: Path) -> None:
    """The whole path: ContentStore creates store.json in a pre-existing 0755 directory."""
    from ckptd.adapters.criu.images import is_pages_image
    from ckptd.core.store.cas import ContentStore, StagingPolicy
    from ckptd.testing import FakeClock

    root = tmp_path / "store"
    root.mkdir()
    root.chmod(0o755)
    ContentStore(LocalBlobStore(root), StagingPolicy(None, tmp_path / "staging"),
                 clock=FakeClock(), is_pages_file=is_pages_image, keys=ManifestKeys.generate())
    assert mode(root / "store.json") == 0o600
    assert mode(root) == 0o700


@pytest.mark.usefixtures("umask_022")
def test_the_key_file_is_created_once_0600(tmp_path: Path) -> None:
    path = tmp_path / "etc" / "manifest.keys"
    keys, created = keyfile.load_or_create(path)
    assert created
    assert mode(path) == 0o600
    assert mode(path.parent) == 0o700
    again, created = keyfile.load_or_create(path)
    assert not created
    assert again == keys
    assert len(keys.keys) == 1
    assert [p.name for p in path.parent.iterdir()] == ["manifest.keys"]  # no temporary left


def test_a_loosened_key_file_is_refused_not_repaired(tmp_path: Path) -> None:
    """Group or others may have read the key: tightening it silently would hide that (ADR
    0014, Amended). The daemon does not start; the operator fixes the mode and rotates."""
    path = tmp_path / "manifest.keys"
    keyfile.load_or_create(path)
    path.chmod(0o644)
    with pytest.raises(ValueError, match=r"has mode 644: group or others .* chmod 600"):
        keyfile.load_or_create(path)
    assert mode(path) == 0o644


def test_several_keys_the_first_signs(tmp_path: Path) -> None:
    new, old = ManifestKeys.generate().keys[0], ManifestKeys.generate().keys[0]
    path = tmp_path / "manifest.keys"
    path.write_text(f"# rotated\n{new.hex()}\n\n{old.hex()}  # the old one\n")
    path.chmod(0o600)
    keys, created = keyfile.load_or_create(path)
    assert not created
    assert keys.signing_id == key_id(new)
    assert keys.ids == (key_id(new), key_id(old))


@pytest.mark.parametrize("text", ["", "# nothing\n", "abcd\n", "zz" * 32 + "\n"],
                         ids=["empty", "comment", "short", "not-hex"])
def test_a_key_file_without_a_valid_key_is_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / "manifest.keys"
    path.write_text(text)
    with pytest.raises(ValueError, match="manifest key file"):
        keyfile.load_or_create(path)


def test_a_key_file_that_is_a_link_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    keyfile.load_or_create(target)
    (tmp_path / "manifest.keys").symlink_to(target)
    with pytest.raises(ValueError, match="manifest key file"):
        keyfile.load_or_create(tmp_path / "manifest.keys")
