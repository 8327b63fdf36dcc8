"""``ckptd`` refuses a bad configuration in one line, before doing anything."""

from __future__ import annotations

import pytest

from ckptd.daemon.main import main


def test_a_socket_path_longer_than_a_unix_socket_takes_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--socket", "/tmp/" + "x" * 120 + "/ckptd.sock"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ckptd: bad configuration: socket path") and "shorter --socket" in err
    assert len(err.splitlines()) == 1


def test_peer_listen_without_certificates_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--peer-listen", "127.0.0.1:7443"]) == 2
    assert "peer_listen needs tls_cert, tls_key and tls_ca" in capsys.readouterr().err


def test_an_unknown_spot_provider_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--spot-providers", "aws,oracle"]) == 2
    assert "unknown spot provider 'oracle'" in capsys.readouterr().err


@pytest.mark.parametrize("path", ["/", "ckptd-jobs", "/a/../b"])
def test_a_jobs_cgroup_that_is_not_below_the_root_is_refused(
    capsys: pytest.CaptureFixture[str], path: str
) -> None:
    assert main(["--jobs-cgroup", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ckptd: bad configuration: jobs_cgroup {path!r} must be")
    assert len(err.splitlines()) == 1


def test_jobs_cgroup_and_cgroup_fs_flags_reach_the_config() -> None:
    from ckptd.daemon.config import load
    from ckptd.daemon.main import parse_args

    config = load(parse_args(["--jobs-cgroup", "/batch/ckptd", "--cgroup-fs", "/host/cg"]))
    assert (config.jobs_cgroup, config.cgroup_fs) == ("/batch/ckptd", "/host/cg")
    assert load(parse_args(["--jobs-cgroup", ""])).jobs_cgroup == ""
    assert load(parse_args([])).jobs_cgroup == "/ckptd-jobs"
