"""The page index (one int per page, filled in bulk) against a plain model of what it must
answer: under any sequence of packs added, condemned and dropped, every page is located in
the same place, ``contains``/``live`` agree, and ``locate`` decodes to the same locations."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.core.store.index import IN_FRAME, SLOT_SHIFT, Location, PageIndex
from ckptd.core.store.packs import FrameInfo, PackIndex
from ckptd.core.store.pagehash import ZERO_REF


class Model:
    """The index as it was: a Location per page, set one page at a time."""

    def __init__(self) -> None:
        self.pages: dict[bytes, Location] = {}
        self.packs: dict[str, PackIndex] = {}
        self.condemned: frozenset[str] = frozenset()

    def add_pack(self, pack: PackIndex) -> None:
        self.packs[pack.pack_id] = pack
        live = pack.pack_id not in self.condemned
        for h, frame, i in pack.entries():
            if h == ZERO_REF:
                continue
            old = self.pages.get(h)
            if old is None or (live and old.pack_id in self.condemned):
                self.pages[h] = Location(pack.pack_id, frame, i)

    def rebuild(self) -> None:
        self.pages = {}
        for pack in sorted(self.packs.values(), key=lambda p: p.pack_id in self.condemned):
            for h, frame, i in pack.entries():
                if h != ZERO_REF:
                    self.pages.setdefault(h, Location(pack.pack_id, frame, i))


HASHES = [bytes([n]) * 16 for n in range(12)]  # bytes([0]) * 16 is ZERO_REF: never located
packs = st.builds(
    lambda name, frames: PackIndex(
        name, tuple(FrameInfo(8, 100, tuple(f)) for f in frames)
    ),
    st.sampled_from(["p1", "p2", "p3", "p4"]),
    st.lists(st.lists(st.sampled_from(HASHES), min_size=1, max_size=6), min_size=1, max_size=3),
)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), packs),
        st.tuples(st.just("condemn"), st.frozensets(st.sampled_from(["p1", "p2", "p3", "p4"]))),
        st.tuples(st.just("drop"), st.sets(st.sampled_from(["p1", "p2", "p3", "p4"]))),
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_the_index_answers_as_the_model(steps: list[tuple[str, object]]) -> None:
    index, model = PageIndex(), Model()
    for op, arg in steps:
        if op == "add":
            assert isinstance(arg, PackIndex)
            index.add_pack(arg)
            model.add_pack(arg)
        elif op == "condemn":
            assert isinstance(arg, frozenset)
            if arg != model.condemned:
                model.condemned = arg
                model.rebuild()
            index.set_condemned(arg)
        else:
            assert isinstance(arg, set)
            for p in arg:
                model.packs.pop(p, None)
            model.rebuild()
            index.drop_packs(arg)
        live = index.live()
        for h in HASHES:
            want = model.pages.get(h)
            assert index.get(h) == want
            usable = want is not None and want.pack_id not in model.condemned
            assert index.contains(h) == usable
            assert (h in live) == usable
        codes, frames = index.locate(HASHES)
        for h, code in zip(HASHES, codes, strict=True):
            want = model.pages.get(h)
            if want is None:
                assert code is None
            else:
                assert code is not None
                assert (*frames[code >> SLOT_SHIFT], code & IN_FRAME) == (
                    want.pack_id, want.frame, want.index
                )
        assert len(index) == len(model.pages)


def test_consecutive_pages_of_a_frame_have_consecutive_codes() -> None:
    index = PageIndex()
    hashes = [bytes([n + 1]) * 16 for n in range(10)]
    index.add_pack(PackIndex("a", (FrameInfo(8, 10, tuple(hashes[:4])),
                                   FrameInfo(18, 10, tuple(hashes[4:])))))
    codes, frames = index.locate(hashes)
    assert [c is not None for c in codes] == [True] * 10
    ints = [c for c in codes if c is not None]
    assert ints[:4] == list(range(ints[0], ints[0] + 4))
    assert ints[4:] == list(range(ints[4], ints[4] + 6))
    assert ints[4] != ints[3] + 1  # another frame: never a continuation
    assert frames[ints[0] >> SLOT_SHIFT] == ("a", 0)
    assert frames[ints[4] >> SLOT_SHIFT] == ("a", 1)
