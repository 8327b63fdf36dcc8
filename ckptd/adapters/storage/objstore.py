"""``BlobStore`` on an object store (S3 and S3-compatible, GCS, Azure) through obstore.

An object put is whole or absent by the object store's own guarantee (a single PUT, or a
multipart upload that becomes visible only when completed), and durable when the request
returns: ``flush`` has nothing to do. ``put(..., if_absent=True)`` is a conditional create
(``If-None-Match: *`` on S3), so racing writers have exactly one winner.

Object stores list by "directory"; ``list(prefix)`` lists the directory part of ``prefix``
and keeps the keys that start with it, so it matches by string prefix like the other stores.
Credentials come the usual way for each cloud (environment, instance / workload metadata),
as obstore finds them; ``config`` may add obstore settings of the store.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

import obstore
from obstore.exceptions import AlreadyExistsError
from obstore.store import from_url as obstore_from_url

from ckptd.errors import BlobNotFound, StoreError

if TYPE_CHECKING:
    from obstore.store import ClientConfig, ObjectStore, RetryConfig
    from typing_extensions import Buffer

    from ckptd.core.ports import BlobStore

SCHEMES = ("s3", "gs", "az", "abfs", "abfss")
"""URL schemes this store serves (``abfs``/``abfss``: Azure Data Lake Gen2 names)."""

MULTIPART_THRESHOLD = 64 * 2**20
"""Objects larger than this are uploaded in parts (``MULTIPART_CHUNK`` each, in parallel)."""
MULTIPART_CHUNK = 16 * 2**20
_MAX_ERROR = 300


class ObjectBlobStore:
    """A ``BlobStore`` (see ``ckptd.core.ports``) over an obstore ``ObjectStore``.

    ``store`` already points at the bucket and prefix; ``location`` is the URL it came from.
    Use ``from_url`` to make one.
    """

    def __init__(self, store: ObjectStore, location: str) -> None:
        self._store = store
        self.location = location

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        endpoint: str | None = None,
        region: str | None = None,
        allow_http: bool = False,
        connect_timeout: float = 5.0,
        timeout: float = 300.0,
        max_retries: int = 10,
        retry_timeout: float = 180.0,
        init_backoff: float = 0.1,
        max_backoff: float = 15.0,
        config: Mapping[str, Any] | None = None,
    ) -> ObjectBlobStore:
        """A store for ``s3://bucket/prefix``, ``gs://bucket/prefix`` or
        ``az://container/prefix`` (the account from ``AZURE_STORAGE_ACCOUNT_NAME`` or
        ``config["account_name"]``; or ``abfs[s]://container@account.dfs.core.windows.net/prefix``).

        ``endpoint``: an S3-compatible or Azure endpoint instead of the cloud's own;
        ``region``: the S3 region; ``allow_http``: permit a plain-HTTP endpoint. Each request
        may take ``timeout`` seconds (``connect_timeout`` to connect); failed requests that
        can be retried are, up to ``max_retries`` times within ``retry_timeout`` seconds,
        with exponential backoff from ``init_backoff`` to ``max_backoff`` seconds.
        """
        scheme = urlsplit(url).scheme.lower()
        if scheme not in SCHEMES:
            raise StoreError(
                f"unsupported object store URL {url!r}",
                hint="use s3://bucket/prefix, gs://bucket/prefix or az://container/prefix",
            )
        settings: dict[str, Any] = dict(config or {})
        if endpoint:
            if scheme == "gs":
                raise StoreError(f"an endpoint cannot be set for {url}: only for s3:// and az://")
            settings["endpoint"] = endpoint
        if region:
            if scheme != "s3":
                raise StoreError(f"a region cannot be set for {url}: only for s3://")
            settings["region"] = region
        client: ClientConfig = {
            "allow_http": allow_http,
            "connect_timeout": timedelta(seconds=connect_timeout),
            "timeout": timedelta(seconds=timeout),
        }
        retry: RetryConfig = {
            "max_retries": max_retries,
            "retry_timeout": timedelta(seconds=retry_timeout),
            "backoff": {
                "init_backoff": timedelta(seconds=init_backoff),
                "max_backoff": timedelta(seconds=max_backoff),
                "base": 2,
            },
        }
        try:
            store = obstore_from_url(
                url, config=cast(Any, settings), client_options=client, retry_config=retry
            )
        except Exception as exc:
            raise StoreError(
                f"cannot open the object store {url}: {_one_line(exc)}",
                hint="check the URL and the store options",
            ) from exc
        return cls(store, url)

    # ---- the BlobStore port --------------------------------------------------------------

    def put_parts(self, key: str, parts: Sequence[Buffer], *, if_absent: bool = False) -> bool:
        return self.put(key, b"".join(parts), if_absent=if_absent)

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        _check_key(key)
        big = len(data) > MULTIPART_THRESHOLD
        try:
            if if_absent:  # a conditional put is always a single request
                obstore.put(self._store, key, data, mode="create", use_multipart=False)
            else:
                obstore.put(
                    self._store, key, data, mode="overwrite", use_multipart=big,
                    chunk_size=MULTIPART_CHUNK,
                )
        except AlreadyExistsError:
            return False
        except Exception as exc:
            raise self._error("write", key, exc) from exc
        return True

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        _check_key(key)
        if start < 0 or (end is not None and end < 0):
            raise StoreError(f"invalid range [{start}, {end}) of {key}")
        if end is not None and end <= start:
            self.size(key)  # a missing object is still an error
            return b""
        try:
            if end is not None:
                return bytes(obstore.get_range(self._store, key, start=start, end=end))
            if start == 0:
                return bytes(obstore.get(self._store, key).bytes())
            found = obstore.get(self._store, key, options={"range": {"offset": start}})
            return bytes(found.bytes())
        except FileNotFoundError as exc:
            raise self._not_found(key) from exc
        except Exception as exc:
            # A range starting beyond the end is "not satisfiable" (416) to the object store
            # and empty to us; any other failure stays one.
            if _is_range_error(exc) and start >= self.size(key):
                return b""
            raise self._error("read", key, exc) from exc

    def size(self, key: str) -> int:
        _check_key(key)
        try:
            return int(obstore.head(self._store, key)["size"])
        except FileNotFoundError as exc:
            raise self._not_found(key) from exc
        except Exception as exc:
            raise self._error("read", key, exc) from exc

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except BlobNotFound:
            return False
        return True

    def list(self, prefix: str = "") -> Iterator[tuple[str, float]]:
        """``(key, modified time)`` of every object whose key starts with ``prefix``."""
        if prefix:
            _check_key(prefix.removesuffix("/"))
        directory = prefix.rpartition("/")[0]
        try:
            for chunk in obstore.list(self._store, directory or None, chunk_size=1000):
                for meta in chunk:
                    key = meta["path"]
                    if key.startswith(prefix):
                        yield key, meta["last_modified"].timestamp()
        except Exception as exc:
            raise self._error("list", prefix or "/", exc) from exc

    def delete(self, key: str) -> None:
        _check_key(key)
        try:
            obstore.delete(self._store, key)
        except FileNotFoundError:
            return
        except Exception as exc:
            raise self._error("delete", key, exc) from exc

    def flush(self) -> None:
        """Nothing to do: an object put is durable when ``put`` returns."""

    def remove_temporaries(self) -> int:
        """Nothing to remove: an upload cut short leaves no visible object (incomplete
        multipart uploads are for the bucket's lifecycle rules to expire)."""
        return 0

    # ---- internals -----------------------------------------------------------------------

    def _not_found(self, key: str) -> BlobNotFound:
        return BlobNotFound(f"object {key} not found in {self.location}")

    def _error(self, what: str, key: str, exc: BaseException) -> StoreError:
        return StoreError(
            f"cannot {what} {key} in {self.location}: {_one_line(exc)}",
            hint="check the object store's endpoint, credentials and permissions",
        )


def _one_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= _MAX_ERROR else text[: _MAX_ERROR - 3] + "..."


def _is_range_error(exc: BaseException) -> bool:
    """Whether ``exc`` may say the range asked for is outside the object (HTTP 416, or a
    range obstore cannot even send)."""
    if isinstance(exc, ValueError | OverflowError):
        return True
    text = str(exc).lower()
    return "416" in text or "range" in text


def _check_key(key: str) -> None:
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in key.split("/")):
        raise StoreError(f"invalid object key {key!r}")


if TYPE_CHECKING:

    def _is_a_blob_store(store: ObjectBlobStore) -> BlobStore:
        return store
