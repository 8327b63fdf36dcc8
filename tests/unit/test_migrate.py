"""MigrateRecipe over real content stores on both sides, a loopback peer and stand-ins for the
dump, the preview and the local restore: every step's undo, and the bytes that travel."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ckptd.adapters.criu.images import is_pages_image
from ckptd.adapters.storage import LocalBlobStore
from ckptd.core.events import EventBus
from ckptd.core.migrate import MigrateRecipe
from ckptd.core.ports import PageFrame
from ckptd.core.receive import Receiver
from ckptd.core.recipe import ProgressSink
from ckptd.core.store import packs as packs_module
from ckptd.core.store.cas import ContentStore, StagingPolicy
from ckptd.core.store.index import pack_key
from ckptd.core.store.keys import ManifestKeys
from ckptd.core.undo import InDoubt, decode_entry
from ckptd.domain import (
    Caller,
    CheckpointRecord,
    CompatReport,
    DumpRequest,
    Event,
    EventKind,
    MigrateOutcome,
    MigrateRequest,
    ProcessFact,
    RestoreOutcome,
    RestoreRequest,
    new_checkpoint_id,
)
from ckptd.errors import (
    CorruptCheckpoint,
    Incompatible,
    PeerError,
    PreconditionFailed,
    TargetRefused,
)
from ckptd.testing import FakeClock, LoopbackPeerConnector, LoopbackPeerSession, MemoryJournal

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
    hold: threading.Event | None = None
    """Set: a restore waits for it (a restore under way)."""

    def preview(self, caller: Caller, request: DumpRequest) -> CheckpointRecord:
        return CheckpointRecord(
            id="", pid=request.pid, created=self.clock.time(), node="node-a", uid=caller.uid,
            processes=(ProcessFact(request.pid, 1, "job", ("job",), caller.uid, caller.uid),),
        )

    def dump(self, caller: Caller, request: DumpRequest, progress: ProgressSink,
             gate: Callable[[str], None] | None = None) -> CheckpointRecord:
        del progress
        self.clock.advance(1)
        record = self.preview(caller, request)
        record = CheckpointRecord(**{**record.__dict__, "id": new_checkpoint_id(
            self.clock.time())})
        images = self.store.begin(record.id)
        (images / "pages-1.img").write_bytes(bytes(self.memory))
        (images / "core-1.img").write_bytes(b"core" * 100)
        if gate is not None:
            gate(record.id)
        committed = self.store.commit(record)
        self.dumps.append(committed)
        return committed

    def restore(self, caller: Caller | RestoreRequest, request: object = None,
                _received: object = None) -> RestoreOutcome:
        req = request if isinstance(request, RestoreRequest) else caller
        assert isinstance(req, RestoreRequest)
        if self.hold is not None:
            assert self.hold.wait(30)
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
        connector=connector, clock=clock,
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


@pytest.mark.parametrize("to", ["b:7443", "nowhere:1"], ids=["reachable", "unreachable"])
def test_a_local_refusal_comes_before_the_target_is_contacted(  # type: ignore[no-untyped-def]
    world, monkeypatch, to: str
) -> None:
    """Issue 21 (11g): `migrate 1` refuses at once, not after waiting for the peer."""
    a, b, connector, recipe = world

    def refuse(caller: Caller, request: DumpRequest) -> CheckpointRecord:
        raise TargetRefused(f"pid {request.pid} is init", pid=request.pid)

    monkeypatch.setattr(recipe, "_preview", refuse)
    with pytest.raises(TargetRefused, match="pid 4321 is init"):
        run(recipe, to=to)
    assert connector.links == []
    assert a.dumps == [] and b.restored == []


def test_a_failure_after_the_dump_restores_the_job_here(world) -> None:  # type: ignore[no-untyped-def]
    a, b, _c, recipe = world
    b.fail_restore = True
    with pytest.raises(Exception, match="restored on this node as pid 4321") as info:
        run(recipe)
    assert len(a.dumps) == 1
    assert [r.checkpoint_id for r in a.restored] == [a.dumps[0].id]
    assert getattr(info.value, "checkpoint_id", None) == a.dumps[0].id


# ---- the link lost during finish: the target asked (core.settle) ----------------------------


@dataclass
class Journaled:
    a: Node
    b: Node
    connector: LoopbackPeerConnector
    recipe: MigrateRecipe
    journal: MemoryJournal
    events: EventBus

    def settled(self) -> list[Event]:
        return [e for e in self.events.recent() if e.kind is EventKind.MIGRATE_SETTLED]

    def failed(self) -> list[Event]:
        return [e for e in self.events.recent() if e.kind is EventKind.MIGRATE_FAILED]


@pytest.fixture
def journaled(world) -> Journaled:  # type: ignore[no-untyped-def]
    """``world``'s nodes, the migration journaled and its events published (as a daemon)."""
    a, b, connector, _recipe = world
    journal, events = MemoryJournal(), EventBus(a.clock)
    recipe = MigrateRecipe(
        preview=a.preview, dump=a.dump, restore_here=a.restore, pages=a.store,
        connector=connector, clock=a.clock, events=events, journal=journal,
        settle_within_s=60,
    )
    return Journaled(a, b, connector, recipe, journal, events)


def test_a_link_lost_after_the_target_restored_asks_it_and_the_job_runs_there(
    journaled: Journaled,
) -> None:
    j = journaled
    j.connector.break_finish = True
    out = run(j.recipe)
    assert isinstance(out, MigrateOutcome) and (out.node, out.pid) == ("node-b", 4321)
    assert len(j.b.restored) == 1 and j.a.restored == [], "it runs there, and only there"
    assert j.connector.asked == [out.checkpoint_id] and j.a.clock.sleeps == []
    assert list(j.journal.pending()) == []
    [settled] = j.settled()
    assert settled.fields["restored_on"] == "target" and settled.pid == 4321
    assert j.failed() == []


def test_a_target_that_died_while_restoring_is_asked_until_back_and_the_job_runs_here(
    journaled: Journaled,
) -> None:
    """Its restore never ran (its session gone with it); it is unreachable three times while
    it restarts (asked again after 0.5, 1, 2 s), then says "not restored": restored here."""
    j = journaled
    j.connector.lose_finish, j.connector.restarting = "dead", 3
    with pytest.raises(PeerError, match=r"said it never restored it.*the tree was restored "
                                        "on this node as pid 4321"):
        run(j.recipe)
    [dumped] = j.a.dumps
    assert j.b.restored == [] and [r.checkpoint_id for r in j.a.restored] == [dumped.id]
    assert j.a.clock.sleeps == [0.5, 1.0, 2.0]
    assert j.connector.asked == [dumped.id]
    assert list(j.journal.pending()) == []
    [settled] = j.settled()
    assert settled.fields["restored_on"] == "source" and settled.checkpoint_id == dumped.id
    assert settled.fields["node"] == "node-b" and settled.pid == 4321
    [failed] = j.failed()
    assert "restored on this node" in failed.message
    assert j.b.receiver is not None
    assert not j.b.receiver.received(dumped.id).restored, "fenced there: never restored"


def test_a_target_still_restoring_is_asked_again_until_it_has(journaled: Journaled) -> None:
    """The link breaks while the target's restore goes on: "restoring" (not a fence) twice,
    then "restored": the migration succeeded, nothing runs here."""
    j = journaled
    j.b.hold = threading.Event()
    j.connector.lose_finish = "detached"

    def restore_ends(_s: float) -> None:
        if len(j.a.clock.sleeps) == 2 and j.b.hold is not None:
            j.b.hold.set()
            assert j.connector.finishing is not None
            j.connector.finishing.join(30)

    j.a.clock.on_sleep(restore_ends)
    out = run(j.recipe)
    assert isinstance(out, MigrateOutcome) and out.node == "node-b"
    assert j.a.clock.sleeps == [0.5, 1.0] and len(j.connector.asked) == 3
    assert len(j.b.restored) == 1 and j.a.restored == []
    assert [e.fields["restored_on"] for e in j.settled()] == ["target"]


def test_no_answer_in_time_keeps_the_entry_and_restores_nothing_until_asked_again(
    journaled: Journaled,
) -> None:
    j = journaled
    j.connector.lose_finish, j.connector.restarting = "dead", 1_000_000
    with pytest.raises(PeerError, match=r"did not answer within 60s.*next start"):
        run(j.recipe)
    assert j.a.restored == [] and j.b.restored == [], "in doubt: nowhere yet"
    assert sum(j.a.clock.sleeps) == pytest.approx(60) and max(j.a.clock.sleeps) == 10.0
    [(op_id, facts)] = j.journal.pending()
    [doubt] = decode_entry(facts).undos
    assert isinstance(doubt, InDoubt) and doubt.uid == USER.uid and doubt.to == "b:7443"
    assert j.settled() == []

    j.connector.unreachable = 0  # back (what a next start does with the entry)
    settled = j.recipe.settler.settle(op_id, doubt)
    assert settled.restored_on == "source" and settled.here is not None
    assert [r.checkpoint_id for r in j.a.restored] == [doubt.checkpoint_id]
    assert list(j.journal.pending()) == []
    assert [e.fields["restored_on"] for e in j.settled()] == ["source"]


def test_a_failed_restore_here_after_not_restored_there_says_neither(
    journaled: Journaled,
) -> None:
    j = journaled
    j.connector.lose_finish = "dead"
    j.a.fail_restore = True
    with pytest.raises(PeerError, match=r"restoring it on this node failed too.*ckptctl restore"):
        run(j.recipe)
    [settled] = j.settled()
    assert settled.fields["restored_on"] == "neither"
    assert [d.id for d in j.a.dumps] and list(j.journal.pending()) == []


def test_a_target_that_cannot_answer_is_not_asked_again(
    journaled: Journaled, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A refusal (an older daemon without the question) is no answer: nothing restored."""
    j = journaled
    assert j.b.receiver is not None

    def refuse(checkpoint_id: str) -> None:
        raise PreconditionFailed("unknown method MigrationOutcome")

    monkeypatch.setattr(j.b.receiver, "received", refuse)
    j.connector.lose_finish = "dead"
    with pytest.raises(PeerError, match="did not answer"):
        run(j.recipe)
    assert j.a.clock.sleeps == [] and j.a.restored == []
    assert len(list(j.journal.pending())) == 1, "in doubt: kept for the next start"


def test_an_entry_too_old_is_left_to_the_operator(journaled: Journaled) -> None:
    j = journaled
    doubt = InDoubt("ck-20260101T000000-aaaaaa", "b:7443", USER.uid,
                    since=j.a.clock.time() - 8 * 86400)
    settled = j.recipe.settler.settle("m-1", doubt)
    assert settled.restored_on == "" and "too long ago" in settled.note
    assert j.connector.asked == [] and j.a.restored == []


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
        connector=connector, clock=clock,
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


# ---- frames as they are ---------------------------------------------------------------------


def stored_frames(st: ContentStore, objects: Path) -> list[bytes]:
    """Every frame of the store's packs, as stored."""
    blobs = LocalBlobStore(objects)
    st.index.refresh(blobs)
    return [
        blobs.get(pack_key(pack_id), f.offset, f.offset + f.length)
        for pack_id, pack in st.index.packs.items() for f in pack.frames
    ]


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> list[list[PageFrame]]:
    """The frames of each ``send``, as they go on the wire."""
    sends: list[list[PageFrame]] = []
    original = LoopbackPeerSession.send

    def spy(self: LoopbackPeerSession, frames: Iterator[PageFrame]) -> int:
        sends.append([])

        def tap() -> Iterator[PageFrame]:
            for frame in frames:
                sends[-1].append(frame)
                yield frame

        return original(self, tap())

    monkeypatch.setattr(LoopbackPeerSession, "send", spy)
    return sends


def text_pages(n: int) -> bytearray:
    return bytearray(b"".join(
        bytes(PAGE) if i % 4 == 0 else (f"line {i} of a log ".encode() * 300)[:PAGE]
        for i in range(n)))


@pytest.mark.parametrize("kind", ["random", "text"])
def test_the_first_move_sends_the_stored_frames_as_they_are_and_the_target_keeps_them(
    world, wire, tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    a, b, _connector, recipe = world
    if kind == "text":
        a.memory = text_pages(64)
    compressed: list[int] = []
    compress = packs_module.pagepath.compress_frame

    def counting(data: bytes | memoryview, level: int) -> bytes | memoryview:
        compressed.append(len(data))
        return compress(data, level)

    monkeypatch.setattr(packs_module.pagepath, "compress_frame", counting)
    out = run(recipe)
    assert isinstance(out, MigrateOutcome) and out.pages_sent == 48
    assert b.receiver is not None and b.receiver.wait_commits(30)
    here = stored_frames(a.store, tmp_path / "a" / "objects")
    assert len(compressed) == len(here), "frames compressed by the dump here, never again"
    frames = wire[0]
    assert frames and all(f.data in here for f in frames), "no frame was made again"
    assert all(f.raw == (kind == "random") for f in frames)
    assert all(f.raw == (len(f.data) == f.pages * PAGE) for f in frames)
    there = stored_frames(b.store, tmp_path / "b" / "objects")
    assert sorted(there) == sorted(here), "the target stored the same frames, not recompressed"
    with a.store.checkout(out.checkpoint_id) as mine, \
            b.store.checkout(out.checkpoint_id) as theirs:
        for name in ("pages-1.img", "core-1.img"):
            assert (mine / name).read_bytes() == (theirs / name).read_bytes()


def test_a_frame_damaged_on_the_wire_aborts_and_the_job_runs_here_again(
    world, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    a, b, _connector, recipe = world
    original = LoopbackPeerSession.send

    def damaging(self: LoopbackPeerSession, frames: Iterator[PageFrame]) -> int:
        def flip() -> Iterator[PageFrame]:
            for i, frame in enumerate(frames):
                data = bytearray(frame.data)
                if i == 0:
                    data[len(data) // 2] ^= 0x40
                yield PageFrame(bytes(data), frame.pages, frame.runs, frame.raw)

        return original(self, flip())

    monkeypatch.setattr(LoopbackPeerSession, "send", damaging)
    with pytest.raises(CorruptCheckpoint, match="restored on this node as pid 4321") as info:
        run(recipe)
    assert "does not match its hash" in str(info.value)
    assert [r.checkpoint_id for r in a.restored] == [a.dumps[0].id]
    assert b.restored == [] and b.store.list() == []


def test_the_second_move_sends_only_the_changed_pages(
    world, wire, tmp_path: Path  # type: ignore[no-untyped-def]
) -> None:
    a, b, _connector, recipe = world
    first = run(recipe)
    a.memory[5 * PAGE : 5 * PAGE + 4] = b"new!"
    a.memory[9 * PAGE : 9 * PAGE + 4] = b"new!"
    second = run(recipe)
    assert isinstance(first, MigrateOutcome) and isinstance(second, MigrateOutcome)
    assert second.pages_sent == 2 and second.pages_total == 48
    assert sum(f.pages for f in wire[1]) == 2
    assert second.bytes_sent < 2 * PAGE + 48 * 16 + 1024
    assert b.receiver is not None and b.receiver.wait_commits(30)
    with a.store.checkout(second.checkpoint_id) as mine, \
            b.store.checkout(second.checkpoint_id) as theirs:
        assert (theirs / "pages-1.img").read_bytes() == bytes(a.memory)
        assert (mine / "pages-1.img").read_bytes() == bytes(a.memory)


def test_a_frame_the_target_has_in_part_travels_as_a_frame_of_the_wanted_pages(
    world, wire  # type: ignore[no-untyped-def]
) -> None:
    a, b, _connector, recipe = world
    b.memory = bytearray(a.memory[: 32 * PAGE])  # the target holds the first half already
    b.dump(USER, DumpRequest(pid=1), lambda _p: None)
    out = run(recipe)
    assert isinstance(out, MigrateOutcome) and out.pages_sent == 24
    assert [f.pages for f in wire[0]] == [24], "one new frame of just the wanted pages"
    assert b.receiver is not None and b.receiver.wait_commits(30)
    with b.store.checkout(out.checkpoint_id) as theirs:
        assert (theirs / "pages-1.img").read_bytes() == bytes(a.memory)
