"""``open_blob_store`` picks the backend a store setting names; the daemon config takes a URL.
No network: object stores are only constructed (obstore connects on first request)."""

from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path

import pytest

from ckptd.adapters.storage import LocalBlobStore, ObjectBlobStore, open_blob_store
from ckptd.adapters.storage.url import is_url, local_path
from ckptd.daemon.config import DEFAULT_URL_STATE_DIR, DaemonConfig, load
from ckptd.errors import BlobNotFound, StoreError


def test_a_plain_path_is_a_local_store(tmp_path: Path) -> None:
    store = open_blob_store(str(tmp_path / "store"))
    assert isinstance(store, LocalBlobStore)
    assert store.root == tmp_path / "store"
    assert (tmp_path / "store").is_dir()


def test_a_file_url_is_a_local_store(tmp_path: Path) -> None:
    store = open_blob_store(f"file://{tmp_path}/my%20store")
    assert isinstance(store, LocalBlobStore)
    assert store.root == tmp_path / "my store"


def test_a_relative_path_with_a_colon_is_still_a_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store = open_blob_store("store:1")
    assert isinstance(store, LocalBlobStore)
    assert store.root == Path("store:1")


@pytest.mark.parametrize(
    "url",
    ["s3://bucket", "s3://bucket/some/prefix", "S3://bucket/p"],
)
def test_s3_urls_are_object_stores(url: str) -> None:
    store = open_blob_store(url, region="eu-west-1", config={"skip_signature": True})
    assert isinstance(store, ObjectBlobStore)
    assert store.location == url
    store.flush()  # nothing to do, no request


def test_s3_with_an_endpoint() -> None:
    store = open_blob_store(
        "s3://bucket/p", endpoint="http://127.0.0.1:9", region="us-east-1", allow_http=True,
        config={"skip_signature": True},
    )
    assert isinstance(store, ObjectBlobStore)


def test_options_left_none_are_not_passed() -> None:
    store = open_blob_store(
        "s3://bucket/p", endpoint=None, region=None, allow_http=None,
        config={"skip_signature": True, "region": "us-east-1"},
    )
    assert isinstance(store, ObjectBlobStore)


@pytest.mark.parametrize(
    "url",
    ["gs://bucket/prefix", "az://container/prefix", "abfs://container/prefix",
     "abfss://container@account.dfs.core.windows.net/prefix"],
)
def test_gcs_and_azure_urls_are_object_stores(url: str) -> None:
    config = {"skip_signature": True}
    if not url.startswith("gs:"):
        config["account_name"] = "account"
    store = open_blob_store(url, config=config)
    assert isinstance(store, ObjectBlobStore)
    assert store.location == url


@pytest.mark.parametrize(
    "url", ["http://example.com/store", "ftp://host/dir", "memory:///", "file://host/dir",
            "nfs://server/export", ""],
)
def test_other_urls_are_refused(url: str) -> None:
    with pytest.raises(StoreError) as info:
        open_blob_store(url)
    text = str(info.value)
    assert "\n" not in text
    if url:
        assert "unsupported store URL" in text
        assert "use a path, file://, s3://, gs:// or az://" in text


def test_a_region_is_only_for_s3() -> None:
    with pytest.raises(StoreError, match="region"):
        open_blob_store("gs://bucket/p", region="us-east-1", config={"skip_signature": True})


def test_a_bad_object_store_option_is_a_store_error() -> None:
    with pytest.raises(StoreError) as info:
        open_blob_store("s3://bucket/p", config={"no_such_setting": "x"})
    assert info.value.__cause__ is not None
    assert "\n" not in str(info.value)


def test_invalid_keys_are_refused_without_a_request() -> None:
    store = open_blob_store("s3://bucket/p", region="us-east-1", config={"skip_signature": True})
    for key in ("", "/abs", "a/../b", "a//b", "."):
        with pytest.raises(StoreError):
            store.put(key, b"x")
        with pytest.raises(StoreError):
            store.get(key)


@pytest.mark.parametrize(
    ("text", "url", "path"),
    [
        ("/var/lib/ckptd", False, Path("/var/lib/ckptd")),
        ("relative/dir", False, Path("relative/dir")),
        ("file:///srv/ckpt", True, Path("/srv/ckpt")),
        ("s3://bucket/p", True, None),
        ("gs://bucket", True, None),
    ],
)
def test_is_url_and_local_path(text: str, url: bool, path: Path | None) -> None:
    assert is_url(text) is url
    assert local_path(text) == path


# ---- DaemonConfig.store --------------------------------------------------------------------


def _args(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = {"config": None, "store": None, "state_dir": None}
    base.update(kw)
    return argparse.Namespace(**base)


def test_the_default_store_is_the_local_directory() -> None:
    config = load(_args())
    assert config.store == "/var/lib/ckptd" == DaemonConfig().store
    assert config.state_dir == Path("/var/lib/ckptd/state")


def test_a_local_store_keeps_its_state_inside(tmp_path: Path) -> None:
    config = load(_args(store=str(tmp_path / "s")))
    assert config.store == str(tmp_path / "s")
    assert config.state_dir == tmp_path / "s" / "state"
    config = load(_args(store=f"file://{tmp_path}/s"))
    assert config.state_dir == tmp_path / "s" / "state"


def test_a_url_store_keeps_its_state_in_the_default_dir() -> None:
    config = load(_args(store="s3://bucket/ckptd"))
    assert config.store == "s3://bucket/ckptd"
    assert config.state_dir == DEFAULT_URL_STATE_DIR == Path("/var/lib/ckptd/state")


def test_an_explicit_state_dir_wins(tmp_path: Path) -> None:
    config = load(_args(store="s3://bucket/ckptd", state_dir=tmp_path / "st"))
    assert config.state_dir == tmp_path / "st"


def test_store_options_from_the_config_file(tmp_path: Path) -> None:
    toml = tmp_path / "ckptd.toml"
    toml.write_text(
        'store = "s3://bucket/ckptd"\nstore_endpoint = "http://127.0.0.1:9000"\n'
        'store_region = "us-east-1"\nstore_allow_http = true\n'
    )
    config = load(_args(config=str(toml)))
    assert config.store == "s3://bucket/ckptd"
    assert config.store_endpoint == "http://127.0.0.1:9000"
    assert config.store_region == "us-east-1"
    assert config.store_allow_http is True
    assert config.state_dir == Path("/var/lib/ckptd/state")


# ---- failures without a server: a loopback port that never answers -------------------------


def test_a_stalled_endpoint_times_out_as_a_store_error() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)  # connections complete in the backlog; nothing ever answers
        store = ObjectBlobStore.from_url(
            "s3://bucket/p", endpoint=f"http://127.0.0.1:{listener.getsockname()[1]}",
            region="us-east-1", allow_http=True, config={"skip_signature": True},
            connect_timeout=0.5, timeout=0.5, max_retries=0, retry_timeout=1.0,
        )
        started = time.monotonic()
        for call in (lambda: store.put("k", b"data"), lambda: store.get("k"),
                     lambda: list(store.list())):
            with pytest.raises(StoreError) as info:
                call()
            assert not isinstance(info.value, BlobNotFound)
            assert info.value.__cause__ is not None
            assert "\n" not in str(info.value)
        assert time.monotonic() - started < 10
