"""scripts/install-systemd.sh, run with --root into a temporary directory: the files it writes,
that it is idempotent, and that it never overwrites an existing config."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest

from ckptd.daemon.config import DaemonConfig

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "install-systemd.sh"
UNIT = ROOT / "systemd" / "ckptd.service"
_SETTING = re.compile(r"^# ([a-z_]+) = (.+)$")


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, check=False
    )


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    """A stand-in virtual environment: just an executable bin/ckptd."""
    path = tmp_path / "venv"
    (path / "bin").mkdir(parents=True)
    exe = path / "bin" / "ckptd"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    return path


def _installed(root: Path) -> tuple[Path, Path, Path]:
    return (
        root / "etc/systemd/system/ckptd.service",
        root / "etc/systemd/system/ckptd.service.d/10-exec.conf",
        root / "etc/ckptd/ckptd.toml",
    )


def test_script_parses() -> None:
    proc = subprocess.run(
        ["bash", "-n", str(SCRIPT)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr


def test_installs_unit_dropin_and_config(tmp_path: Path, venv: Path) -> None:
    root = tmp_path / "root"
    proc = _run("--root", root, "--venv", venv)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    unit, dropin, config = _installed(root)
    assert unit.read_text() == UNIT.read_text()
    assert unit.stat().st_mode & 0o777 == 0o644
    lines = dropin.read_text().splitlines()
    assert "[Service]" in lines
    # ExecStart= is reset first, else systemd would refuse a second ExecStart for Type=notify
    reset, start = lines.index("ExecStart="), lines.index(
        f"ExecStart={venv}/bin/ckptd --config /etc/ckptd/ckptd.toml"
    )
    assert lines.index("[Service]") < reset < start
    assert config.is_file()
    assert "installed under" in proc.stdout
    assert "systemctl daemon-reload && systemctl enable --now ckptd" in proc.stdout


def test_config_is_all_defaults_commented_out(tmp_path: Path, venv: Path) -> None:
    root = tmp_path / "root"
    assert _run("--root", root, "--venv", venv).returncode == 0
    text = _installed(root)[2].read_text()
    assert tomllib.loads(text) == {}, "nothing may be set: every line is a comment"
    settings = {
        m.group(1): tomllib.loads(f"v = {m.group(2)}")["v"]
        for line in text.splitlines()
        if (m := _SETTING.match(line))
    }
    known = {f.name: f.default for f in fields(DaemonConfig)}
    # only real settings (a typo would make the daemon refuse the file once uncommented), and
    # at least the essential ones; settings added later may be missing from the template
    assert set(settings) <= set(known), set(settings) - set(known)
    assert {"socket", "socket_group", "store", "state_dir", "criu_path", "peer_listen"} <= set(
        settings
    )
    for name, written in settings.items():
        value, default = written, known[name]
        if name == "socket_mode":
            value = int(written, 8)
        elif isinstance(default, Path):
            default = str(default)
        assert value == default, f"{name}: {value!r} in the file, default {default!r}"


def test_second_run_keeps_an_edited_config_and_restores_the_unit(
    tmp_path: Path, venv: Path
) -> None:
    root = tmp_path / "root"
    assert _run("--root", root, "--venv", venv).returncode == 0
    unit, dropin, config = _installed(root)
    edited = 'store = "s3://bucket/ckpt"\n'
    config.write_text(edited)
    unit.write_text("[Service]\nExecStart=/bogus\n")
    dropin_before = dropin.read_text()

    proc = _run("--root", root, "--venv", venv)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert config.read_text() == edited
    assert f"kept: {config}" in proc.stdout
    assert unit.read_text() == UNIT.read_text()
    assert f"updated: {unit}" in proc.stdout
    assert dropin.read_text() == dropin_before
    assert f"unchanged: {dropin}" in proc.stdout


def test_rerun_with_another_venv_rewrites_the_dropin(tmp_path: Path, venv: Path) -> None:
    root = tmp_path / "root"
    assert _run("--root", root, "--venv", venv).returncode == 0
    other = tmp_path / "other-venv"
    shutil.copytree(venv, other)
    assert _run("--root", root, "--venv", other).returncode == 0
    assert f"ExecStart={other}/bin/ckptd " in _installed(root)[1].read_text()


def test_dry_run_changes_nothing(tmp_path: Path, venv: Path) -> None:
    root = tmp_path / "root"
    proc = _run("--dry-run", "--root", root, "--venv", venv)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert not root.exists()
    assert proc.stdout.count("would write:") == 3


def test_dry_run_on_this_machine_touches_nothing(venv: Path) -> None:
    proc = _run("--dry-run", "--venv", venv)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "/etc/systemd/system/ckptd.service" in proc.stdout
    if Path("/run/systemd/system").is_dir():
        assert "would run: systemctl enable --now ckptd" in proc.stdout
    else:
        assert "systemd is not running here; installed the unit, start it with" in proc.stdout


def test_missing_venv_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    proc = _run("--root", root, "--venv", tmp_path / "no-venv")
    assert proc.returncode == 1
    assert "bin/ckptd not found" in proc.stderr
    assert not _installed(root)[0].exists()


def test_unknown_argument_is_a_usage_error() -> None:
    proc = _run("--frobnicate")
    assert proc.returncode == 2
    assert "unknown argument" in proc.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
@pytest.mark.skipif(
    not (ROOT / ".venv" / "bin" / "ckptd").exists(), reason="no .venv/bin/ckptd in the checkout"
)
def test_installed_unit_with_dropin_verifies(tmp_path: Path) -> None:
    # the checkout's own venv (the default): systemd-analyze checks ExecStart is executable,
    # and reads the drop-in next to the unit, so this proves the reset + new ExecStart works
    root = tmp_path / "root"
    proc = _run("--root", root)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    unit = _installed(root)[0]
    verify = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, check=False
    )
    problems = [
        ln for ln in (verify.stderr + verify.stdout).splitlines()
        if "ckptd.service" in ln and "Documentation" not in ln
    ]
    assert verify.returncode == 0 and not problems, verify.stderr + verify.stdout
