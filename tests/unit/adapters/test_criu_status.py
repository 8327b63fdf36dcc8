"""CriuSwrk.status(): missing, too old, failing `criu check` — each a clear reason; no root."""

from __future__ import annotations

import stat
from pathlib import Path

from ckptd.adapters.criu import CriuSwrk


def fake_criu(tmp_path: Path, version: str, check_rc: int = 0, check_out: str = "") -> Path:
    script = tmp_path / "criu"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "Version: ' + version + '"; exit 0; fi\n'
        'if [ "$1" = "check" ]; then echo "' + check_out + '" >&2; exit ' + str(check_rc)
        + "; fi\nexit 1\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_missing_criu_says_where_it_looked(tmp_path: Path) -> None:
    status = CriuSwrk(str(tmp_path / "nope"), plugin_dir=tmp_path / "p").status()
    assert not status.ok
    assert status.message == f"CRIU not found at {tmp_path / 'nope'}"


def test_too_old_criu_names_both_versions(tmp_path: Path) -> None:
    status = CriuSwrk(str(fake_criu(tmp_path, "3.17.1")), plugin_dir=tmp_path / "p").status()
    assert not status.ok
    assert status.version == "3.17.1"
    assert "CRIU 3.17.1" in status.message and "too old" in status.message
    assert ">= 4.1" in status.message


def test_failing_check_carries_criu_s_words(tmp_path: Path) -> None:
    criu = fake_criu(tmp_path, "4.1.1", 1, "vdso: Unexpected rt vDSO area bounds")
    status = CriuSwrk(str(criu), plugin_dir=tmp_path / "p").status()
    assert not status.ok
    assert "check` failed" in status.message
    assert "Unexpected rt vDSO area bounds" in status.message


def test_a_good_criu_is_ok_and_its_answer_is_kept(tmp_path: Path) -> None:
    criu = fake_criu(tmp_path, "4.1.1")
    adapter = CriuSwrk(str(criu), plugin_dir=tmp_path / "p")
    assert adapter.status().ok
    criu.unlink()  # a good answer is not asked again
    assert adapter.status().ok
    assert adapter.status().version == "4.1.1"
