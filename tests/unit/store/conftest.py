from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.core.store import pagepath

from .support import Backend, make_backend


@pytest.fixture(params=["memory", "local"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """A fresh ``BlobStore`` of each kind: ``MemoryBlobStore`` and ``LocalBlobStore``."""
    return make_backend(request.param, tmp_path)


@pytest.fixture(scope="module", params=["native", "python"])
def data_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """The module's tests run on each per-page data path: ckptd._pages, and the pure-Python
    fallback that runs when it is not built."""
    if request.param == "native" and not pagepath.is_native():
        pytest.skip("ckptd._pages is not built (pip install -e . with libzstd-dev, libxxhash-dev)")
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "python":
            mp.setattr(pagepath, "_native", None)
        yield request.param
