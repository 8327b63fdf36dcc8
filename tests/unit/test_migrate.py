"""MigrateRecipe over real content stores on both sides, a loopback peer and stand-ins for the
dump, the preview and the local restore: every step's undo, and the bytes that travel."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ckptd.adapters.criu.images import is_pages_image
from ckptd.adapters.storage import LocalBlobStore
from ckptd.core.migrate import MigrateRecipe
from ckptd.core.receive import Receiver
from ckptd.core.recipe import ProgressSink
from ckptd.core.store.cas import ContentStore, StagingPolicy
from ckptd.core.store.keys import ManifestKeys
from ckptd.domain import (
    Caller,
    CheckpointRecord,
    CompatReport,
    DumpRequest,
    MigrateRequest,
    ProcessFact,
    RestoreOutcome,
    RestoreRequest,
    new_checkpoint_id,
)
from ckptd.errors import Incompatible, PeerError
from ckptd.testing import FakeClock, LoopbackPeerConnector

PAGE = 4096
KEYS = ManifestKeys.generate()
USER = Caller(uid=1000)


def store(root: Path, clock: FakeClock, objects: Path | None = None) -> ContentStore:
    return ContentStore(
        LocalBlobStore(objects or root / "objects"), StagingPolicy(None, root / "staging"),
        clock=clock, is_pages_file=is_pages_image, keys=KEYS,
    )


@dataclass
class Node:
    """One side: its store; the source side's dump writes ``memory`` as a checkpoint."""

    store: ContentStore
    clock: FakeClock
    memory: bytearray = field(default_factory=bytearray)
    dumps: list[CheckpointRecord] = field(default_factory=list)
    restored: list[RestoreRequest] = field(default_factory=list)
    blocking: list[str] = field(default_factory=list)
    fail_restore: bool = False
    receiver: Receiver | None = None

    def preview(self, caller: Caller, request: DumpRequest) -> CheckpointRecord:
        return CheckpointRecord(
            id="", pid=request.pid, created=self.clock.time(), node="node-a", uid=caller.uid,
            processes=(ProcessFact(request.pid, 1, "job", ("job",), caller.uid, caller.uid),),
        )

    def dump(self, caller: Caller, request: DumpRequest, progress: ProgressSink
             ) -> CheckpointRecord:
        del progress
        self.clock.advance(1)
        record = self.preview(caller, request)
        record = CheckpointRecord(**{**record.__dict__, "id": new_checkpoint_id(
            self.clock.time())})
        images = self.store.begin(record.id)
        (images / "pages-1.img").write_bytes(bytes(self.memory))
        (images / "core-1.img").write_bytes(b"core" * 100)
        committed = self.store.commit(record)
        self.dumps.append(committed)
        return committed

    def restore(self, caller: Caller | RestoreRequest, request: object = None
                ) -> RestoreOutcome:
        req = request if isinstance(request, RestoreRequest) else caller
        assert isinstance(req, RestoreRequest)
        if self.fail_restore:
            from ckptd.errors import CriuFailed
            raise CriuFailed("CRIU restore failed: pid 4321 in use")
        self.restored.append(req)
        return RestoreOutcome(req.checkpoint_id, 4321, req.output_path, 0.01)

    def check(self, record: CheckpointRecord) -> CompatReport:
        del record
        return CompatReport(blocking=tuple(self.blocking))


@pytest.fixture
def world(tmp_path: Path) -> tuple[Node, Node, LoopbackPeerConnector, MigrateRecipe]:
    clock = FakeClock()
    a = Node(store(tmp_path / "a", clock), clock)
    b = Node(store(tmp_path / "b", clock), clock)
    rng = random.Random(7)
    a.memory = bytearray(b"".join(
        bytes(PAGE) if i % 4 == 0 else rng.randbytes(PAGE) for i in range(64)))
    connector = LoopbackPeerConnector()
    b.receiver = Receiver(store=b.store, pages=b.store, check=b.check, restore=b.restore,
                          clock=clock, node="node-b")
    connector.add("b:7443", b.receiver)
    recipe = MigrateRecipe(
        preview=a.preview, dump=a.dump, restore_here=a.restore, pages=a.store,
        connector=connector, clock=clock, executor=ThreadPoolExecutor(2),
        is_pages_file=is_pages_image,
    )
    return a, b, connector, recipe


def run(recipe: MigrateRecipe, to: str = "b:7443") -> object:
    return recipe.run(USER, MigrateRequest(pid=4321, to=to), lambda _p: None)


def test_only_missing_pages_travel_and_the_target_gets_the_same_images(world) -> None:  # type: ignore[no-untyped-def]
    a, b, connector, recipe = world
    first = recipe.run(USER, MigrateRequest(pid=4321, to="b:7443"), lambda _p: None)
    assert first.pages_total == first.pages_sent == 48 and first.node == "node-b"
    assert [r.checkpoint_id for r in b.restored] == [first.checkpoint_id]
    assert b.receiver is not None and b.receiver.wait_commits(30)
    with a.store.checkout(first.checkpoint_id) as here, \
            b.store.checkout(first.checkpoint_id) as there:
        for name in ("pages-1.img", "core-1.img"):
            assert (here / name).read_bytes() == (there / name).read_bytes()
    assert a.restored == [] and all(link.closed for link in connector.links)

    a.memory[5 * PAGE : 5 * PAGE + 4] = b"new!"
    second = recipe.run(USER, MigrateRequest(pid=4321, to="b:7443"), lambda _p: None)
    assert second.pages_sent == 1
    assert second.bytes_sent < first.bytes_sent // 10


def test_a_blocking_difference_refuses_before_the_dump(world) -> None:  # type: ignore[no-untyped-def]
    a, b, _c, recipe = world
    b.blocking = ["GPU model differs: checkpoint has NVIDIA A100 x2, this node has H100 x2"]
    with pytest.raises(Incompatible, match="nothing was touched") as info:
        run(recipe)
    assert "node node-b (b:7443) cannot restore pid 4321" in str(info.value)
    assert a.dumps == [] and a.restored == [] and b.restored == []


def test_an_unreachable_target_dumps_nothing(world) -> None:  # type: ignore[no-untyped-def]
    a, _b, _c, recipe = world
    with pytest.raises(PeerError, match="cannot reach"):
        run(recipe, to="nowhere:1")
    assert a.dumps == []


def test_a_failure_after_the_dump_restores_the_job_here(world) -> None:  # type: ignore[no-untyped-def]
    a, b, _c, recipe = world
    b.fail_restore = True
    with pytest.raises(Exception, match="restored on this node as pid 4321") as info:
        run(recipe)
    assert len(a.dumps) == 1
    assert [r.checkpoint_id for r in a.restored] == [a.dumps[0].id]
    assert getattr(info.value, "checkpoint_id", None) == a.dumps[0].id


def test_a_link_lost_during_finish_restores_nothing_twice(world) -> None:  # type: ignore[no-untyped-def]
    a, b, connector, recipe = world
    connector.break_finish = True
    with pytest.raises(PeerError, match="check there whether pid 4321 runs"):
        run(recipe)
    assert len(b.restored) == 1, "the target did restore it"
    assert a.restored == [], "so it must not run here as well"


def test_a_shared_store_sends_nothing(tmp_path: Path) -> None:
    clock = FakeClock()
    objects = tmp_path / "shared"
    a = Node(store(tmp_path / "a", clock, objects), clock, memory=bytearray(b"x" * PAGE * 8))
    b = Node(store(tmp_path / "b", clock, objects), clock)
    connector = LoopbackPeerConnector()
    connector.add("b:7443", Receiver(store=b.store, pages=b.store, check=b.check,
                                     restore=b.restore, clock=clock, node="node-b"))
    recipe = MigrateRecipe(
        preview=a.preview, dump=a.dump, restore_here=a.restore, pages=a.store,
        connector=connector, clock=clock, executor=ThreadPoolExecutor(1),
        is_pages_file=is_pages_image,
    )
    out = recipe.run(USER, MigrateRequest(pid=4321, to="b:7443"), lambda _p: None)
    assert out.shared_store and out.pages_sent == 0 and out.bytes_sent == 0
    assert [r.checkpoint_id for r in b.restored] == [out.checkpoint_id]


def test_big_images_are_offered_in_slices(world, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import ckptd.core.migrate as migrate_module

    monkeypatch.setattr(migrate_module, "OFFER_PAGES", 10)
    a, b, _connector, recipe = world
    out = recipe.run(USER, MigrateRequest(pid=4321, to="b:7443"), lambda _p: None)
    assert out.pages_sent == out.pages_total == 48
    assert b.receiver is not None and b.receiver.wait_commits(30)
    with a.store.checkout(out.checkpoint_id) as here, b.store.checkout(out.checkpoint_id) as there:
        assert (here / "pages-1.img").read_bytes() == (there / "pages-1.img").read_bytes()
