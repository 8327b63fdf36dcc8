"""Fixtures of the contract suites: one fixture per port, parametrized over the
implementations listed in ``harness.py`` (a new backend is one line there)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.core.ports import CheckpointStore

from .harness import (
    BLOBSTORES,
    JOURNALS,
    PROCESS_TABLES,
    STORES,
    BlobStoreHarness,
    JournalHarness,
    ProcessHarness,
)


@pytest.fixture(params=sorted(STORES))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStore:
    return STORES[request.param](tmp_path)


@pytest.fixture(params=sorted(JOURNALS))
def journal_harness(request: pytest.FixtureRequest, tmp_path: Path) -> JournalHarness:
    return JOURNALS[request.param](tmp_path)


@pytest.fixture(params=sorted(PROCESS_TABLES))
def processes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ProcessHarness]:
    harness = PROCESS_TABLES[request.param](tmp_path)
    try:
        yield harness
    finally:
        harness.close()


@pytest.fixture(params=sorted(BLOBSTORES))
def blobstore(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStoreHarness:
    return BLOBSTORES[request.param](tmp_path)


# ---- GPUs (appended section: see harness.py) ----------------------------------------------

from .harness import GPUS, GpuHarness  # noqa: E402


@pytest.fixture(params=sorted(GPUS))
def gpu(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[GpuHarness]:
    """Each GPU implementation; the real one is skipped, with the reason, without a GPU."""
    harness = GPUS[request.param](tmp_path)
    try:
        if harness.skip_reason is not None:
            pytest.skip(harness.skip_reason)
        yield harness
    finally:
        harness.close()


# ---- S3 (appended section: see harness.py and moto_server.py) ------------------------------

from . import moto_server  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _stop_moto_server() -> Iterator[None]:
    """The moto server starts on first use (the "s3" backend) and stops when the session ends."""
    yield
    moto_server.stop_shared()
