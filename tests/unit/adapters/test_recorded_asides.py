"""Issue 33 (6): the record of the copies restores kept aside (``FileAsideLog``: durable,
bounded, a damaged file left out), and their removal by identity (``remove_recorded``): only
the very file recorded, never one merely at its name, never through a link."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptd.adapters.procfs.asides import CHANGED, GONE, THERE, examine, remove_recorded
from ckptd.adapters.procfs.safefs import Root, UnsafePath
from ckptd.adapters.storage.asidelog import FileAsideLog
from ckptd.core.ports.asides import AsideRecord


def _record(path: str, restore_id: str = "r1", made: float = 1.0, **kw: int) -> AsideRecord:
    return AsideRecord(path=path, dev=kw.get("dev", 1), ino=kw.get("ino", 2),
                       uid=kw.get("uid", 1000), restore_id=restore_id,
                       checkpoint_id="ck-20260101T000000-abcdef", owner=1000, made=made)


def test_records_survive_a_restart_and_are_forgotten(tmp_path: Path) -> None:
    log = FileAsideLog(tmp_path / "asides")
    a, b = _record("/j/a.log.ckptd-r1"), _record("/j/b.log.ckptd-r1", made=2.0)
    log.add([b, a])
    c = _record("/j/a.log.ckptd-r2", "r2", made=3.0)
    log.add([c])
    again = FileAsideLog(tmp_path / "asides")  # the daemon restarted
    assert again.records() == (a, b, c)
    again.forget([a, c])
    assert again.records() == (b,)
    assert sorted(p.name for p in (tmp_path / "asides").iterdir()) == ["r1.json"]


def test_the_oldest_restores_records_go_beyond_the_limit(tmp_path: Path) -> None:
    log = FileAsideLog(tmp_path / "asides", limit=2)
    records = [_record(f"/j/x.ckptd-r{i}", f"r{i}", made=float(i)) for i in range(3)]
    for i, r in enumerate(records):
        log.add([r])
        os.utime(tmp_path / "asides" / f"r{i}.json", (i + 1.0, i + 1.0))
    assert log.records() == tuple(records[1:])


def test_a_damaged_record_file_is_left_out_and_a_bad_id_refused(tmp_path: Path) -> None:
    log = FileAsideLog(tmp_path / "asides")
    log.add([_record("/j/a.ckptd-r1")])
    (tmp_path / "asides" / "r9.json").write_text('[{"path": "relative", "dev": -1}]')
    assert [r.path for r in log.records()] == ["/j/a.ckptd-r1"]
    with pytest.raises(ValueError, match="one restore id"):
        log.add([_record("/j/a.ckptd-x", "../escape")])


def _made(path: Path, content: bytes = b"found\n") -> os.stat_result:
    path.write_bytes(content)
    return os.stat(path)


def test_only_the_very_copy_recorded_is_removed(tmp_path: Path) -> None:
    aside = tmp_path / "job.log.ckptd-r1"
    st = _made(aside)
    root = Root.node()
    try:
        ident = (st.st_dev, st.st_ino, st.st_uid)
        assert examine(root, str(aside), *ident).state == THERE
        # another file at its name (made while the copy still existed: another inode):
        # left alone
        planted = _made(tmp_path / "planted", b"someone else's\n")
        os.replace(tmp_path / "planted", aside)
        assert examine(root, str(aside), *ident).state == CHANGED
        why = remove_recorded(root, str(aside), *ident)
        assert why.startswith("another file than the copy kept has its name now"), why
        assert aside.read_bytes() == b"someone else's\n"
        # the same inode owned by another uid than recorded: not the copy either
        assert examine(root, str(aside), planted.st_dev, planted.st_ino,
                       planted.st_uid + 1).state == CHANGED
        assert aside.exists()
        # the very file: removed; then gone
        assert remove_recorded(root, str(aside), planted.st_dev, planted.st_ino,
                               planted.st_uid) == ""
        assert not aside.exists()
        assert examine(root, str(aside), *ident).state == GONE
        assert remove_recorded(root, str(aside), *ident) == "it is gone already"
    finally:
        root.close()


def test_a_link_at_the_name_or_on_the_way_is_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    st = _made(victim, b"precious\n")
    ident = (st.st_dev, st.st_ino, st.st_uid)
    at_name = tmp_path / "job.log.ckptd-r1"
    at_name.symlink_to(victim)
    (tmp_path / "real").mkdir()
    (tmp_path / "dirlink").symlink_to(tmp_path)
    root = Root.node()
    try:
        assert examine(root, str(at_name), *ident).state == CHANGED
        assert remove_recorded(root, str(at_name), *ident).startswith("another file")
        with pytest.raises(UnsafePath, match="symbolic link"):
            remove_recorded(root, str(tmp_path / "dirlink" / "victim"), *ident)
    finally:
        root.close()
    assert victim.read_bytes() == b"precious\n" and at_name.is_symlink()
