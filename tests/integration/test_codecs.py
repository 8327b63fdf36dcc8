"""Issue 35: a daemon whose store writes LZ4 frames (or zstd at a fast level) dumps a job
through real CRIU and restores it: its output goes on bit for bit, and the store really holds
frames of that codec (``bigmem``'s mixed pages compress; random ones would be stored raw)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ckptd.adapters.storage import LocalBlobStore
from ckptd.core.store.index import load_pack_index, pack_key
from ckptd.core.store.pagepath import LZ4_MAGIC, ZSTD_MAGIC

from .flows import dump_and_restore_via_pipe
from .support import Daemon, Procs, workload

pytestmark = pytest.mark.integration


def _frame_magics(store: Path) -> set[bytes]:
    """The first four bytes of every frame of every pack in the store."""
    blobs = LocalBlobStore(store)
    magics = set()
    for key, _mtime in blobs.list("packs/"):
        pack_id = key.rsplit("/", 1)[-1]
        stored = blobs.get(pack_key(pack_id))
        for frame in load_pack_index(blobs, pack_id).frames:
            magics.add(stored[frame.offset : frame.offset + 4])
    return magics


@pytest.mark.parametrize(("codec", "level", "magic"), [("lz4", 0, LZ4_MAGIC),
                                                      ("zstd", -3, ZSTD_MAGIC)])
def test_a_job_dumped_with_another_codec_restores_bit_for_bit(
    start_daemon: Callable[..., Daemon], procs: Procs, tmp_path: Path, codec: str, level: int,
    magic: bytes,
) -> None:
    daemon = start_daemon(config={"compression": codec, "compress_level": level})
    cmd = workload("bigmem", "--mib", 48, "--steps", 30)
    ck, _ = dump_and_restore_via_pipe(daemon, procs, tmp_path, cmd)
    assert ck["bytes"] < ck["bytes_logical"], "mixed pages must compress"
    assert magic in _frame_magics(daemon.store)
