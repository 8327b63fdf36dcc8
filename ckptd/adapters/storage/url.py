"""``open_blob_store``: the ``BlobStore`` a store setting names (a path or a URL)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from ckptd.adapters.storage.localfs import LocalBlobStore
from ckptd.errors import StoreError

if TYPE_CHECKING:
    from ckptd.core.ports import BlobStore

OBJECT_SCHEMES = ("s3", "gs", "az", "abfs", "abfss")
_HINT = "use a path, file://, s3://, gs:// or az://"


def is_url(url_or_path: str) -> bool:
    """Whether ``url_or_path`` is a URL (``scheme://...``) rather than a path."""
    scheme, sep, _ = url_or_path.partition("://")
    return bool(sep) and scheme.isascii() and scheme.replace("+", "").isalnum()


def local_path(url_or_path: str) -> Path | None:
    """The directory of a local store (a path or ``file:///path``), None for any URL else."""
    if not is_url(url_or_path):
        return Path(url_or_path)
    parts = urlsplit(url_or_path)
    if parts.scheme.lower() == "file" and parts.netloc in ("", "localhost") and parts.path:
        return Path(unquote(parts.path))
    return None


def open_blob_store(url_or_path: str, **opts: Any) -> BlobStore:
    """A plain path or ``file:///path``: ``LocalBlobStore``; ``s3://``, ``gs://``, ``az://``
    (and ``abfs[s]://``): ``ObjectBlobStore``, made with ``opts`` (see
    ``ObjectBlobStore.from_url``; options left None are not passed). Anything else raises
    ``StoreError``."""
    if not url_or_path.strip():
        raise StoreError(f"empty store location; {_HINT}")
    scheme = urlsplit(url_or_path).scheme.lower() if is_url(url_or_path) else ""
    if scheme in ("", "file"):
        path = local_path(url_or_path)
        if path is None:
            raise StoreError(
                f"unsupported store URL {url_or_path!r}: file:// needs an absolute local path",
                hint=_HINT,
            )
        return LocalBlobStore(path)
    if scheme in OBJECT_SCHEMES:
        from ckptd.adapters.storage.objstore import ObjectBlobStore

        return ObjectBlobStore.from_url(
            url_or_path, **{k: v for k, v in opts.items() if v is not None}
        )
    raise StoreError(f"unsupported store URL {url_or_path!r}", hint=_HINT)
