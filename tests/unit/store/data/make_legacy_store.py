"""Made tests/unit/store/data/legacy-store-e0052b0.tar.gz: a store written by ckptd at commit
e0052b0 (before raw frames, docs/adr/0012: every frame zstd, also one of pages that do not
compress). Kept to show how; it is not run by the tests:

    git archive e0052b0 | tar -x -C /tmp/before
    PYTHONPATH=/tmp/before python tests/unit/store/data/make_legacy_store.py /tmp/legacy
    tar -C /tmp/legacy -czf tests/unit/store/data/legacy-store-e0052b0.tar.gz objects
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

from ckptd.adapters.criu.images import is_pages_image
from ckptd.adapters.storage import LocalBlobStore
from ckptd.core.store.cas import ContentStore, StagingPolicy
from ckptd.domain import CheckpointRecord, ProcessFact
from ckptd.testing import FakeClock

CHECKPOINT = "ck-20240101T000000-01d0ff"
PAGE = 4096


def main(root: Path) -> None:
    rng = random.Random(2024)
    text = b"".join(
        f'{{"id":{rng.randrange(10**7)},"user":"u{rng.randrange(99)}"}}\n'.encode()
        for _ in range(2000)
    )
    files = {
        "pages-1.img": rng.randbytes(8 * PAGE),  # does not compress: zstd frame of raw blocks
        "pages-2.img": text[: 6 * PAGE] + bytes(2 * PAGE) + rng.randbytes(PAGE),
        "core-1.img": b"core" + rng.randbytes(100),
        "inventory.img": b"inventory",
    }
    clock = FakeClock()
    store = ContentStore(LocalBlobStore(root / "objects"), StagingPolicy(None, root / "staging"),
                         clock=clock, is_pages_file=is_pages_image)
    clock.advance(1)
    rec = CheckpointRecord(
        id=CHECKPOINT, pid=4321, created=clock.time(), node="node-a", uid=1000, name="job",
        processes=(ProcessFact(4321, 1, "job", ("job",), 1000, 1000),),
    )
    images = store.begin(rec.id)
    for name, data in files.items():
        (images / name).write_bytes(data)
    store.commit(rec)
    print(json.dumps({n: hashlib.sha256(d).hexdigest() for n, d in files.items()}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
