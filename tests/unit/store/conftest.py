from __future__ import annotations

from pathlib import Path

import pytest

from .support import Backend, make_backend


@pytest.fixture(params=["memory", "local"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """A fresh ``BlobStore`` of each kind: ``MemoryBlobStore`` and ``LocalBlobStore``."""
    return make_backend(request.param, tmp_path)
