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
