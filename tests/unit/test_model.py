"""Domain values: checkpoint ids, JSON round trip of records (with hypothesis)."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptd.domain import (
    Caller,
    CheckpointRecord,
    ProcessFact,
    StdioFact,
    StdioKind,
    new_checkpoint_id,
)
from ckptd.domain.model import ROOT, is_checkpoint_id

# the range a wall clock can be: 1970 .. end of year 9999 (ids have a 4-digit year)
times = st.floats(min_value=0, max_value=253402300799.0, allow_nan=False)
text = st.text(max_size=20)
ints = st.integers(min_value=0, max_value=2**31 - 1)
floats = st.floats(allow_nan=False, allow_infinity=False)

process_facts = st.builds(
    ProcessFact,
    pid=ints,
    ppid=ints,
    comm=text,
    cmdline=st.lists(text, max_size=4).map(tuple),
    uid=ints,
    gid=ints,
    threads=st.integers(min_value=1, max_value=1000),
)
stdio_facts = st.builds(
    StdioFact,
    pid=ints,
    fd=st.integers(min_value=0, max_value=2),
    kind=st.sampled_from(StdioKind),
    target=text,
    writable=st.booleans(),
    external_key=text,
)
records = st.builds(
    CheckpointRecord,
    id=times.map(new_checkpoint_id),
    pid=ints,
    created=times,
    node=text,
    uid=ints,
    name=text,
    labels=st.dictionaries(text, text, max_size=4),
    leave_running=st.booleans(),
    processes=st.lists(process_facts, max_size=4).map(tuple),
    stdio=st.lists(stdio_facts, max_size=4).map(tuple),
    bytes=ints,
    bytes_logical=ints,
    bytes_new=ints,
    frozen_s=floats,
    duration_s=floats,
    criu_version=text,
    parent_id=text,
)


@given(records)
def test_record_json_round_trip(record: CheckpointRecord) -> None:
    encoded = json.dumps(record.to_json())
    assert CheckpointRecord.from_json(json.loads(encoded)) == record


@given(records)
def test_record_to_json_is_plain_json(record: CheckpointRecord) -> None:
    data = json.loads(json.dumps(record.to_json()))
    assert data["stdio"] == [{**s, "kind": StdioKind(s["kind"]).value} for s in data["stdio"]]
    assert isinstance(data["labels"], dict)


def test_from_json_ignores_unknown_keys() -> None:
    record = CheckpointRecord(id=new_checkpoint_id(0), pid=1, created=0.0, node="n", uid=0)
    data = {**record.to_json(), "added_in_v2": {"x": 1}}
    assert CheckpointRecord.from_json(data) == record


@given(times)
def test_new_checkpoint_id_is_a_checkpoint_id_and_never_all_digits(now: float) -> None:
    ckpt = new_checkpoint_id(now)
    assert is_checkpoint_id(ckpt)
    assert not ckpt.isdigit()
    assert re.fullmatch(r"ck-\d{8}T\d{6}-[0-9a-f]{6}", ckpt)


def test_checkpoint_ids_sort_by_creation_time() -> None:
    assert new_checkpoint_id(1_700_000_000) < new_checkpoint_id(1_700_000_001)
    assert new_checkpoint_id(0).startswith("ck-19700101T000000-")


@pytest.mark.parametrize(
    "text", ["", "1234", "ck-", "ck-20240101T000000-ABCDEF", "ck-20240101T000000-abcdef0",
             " ck-20240101T000000-abcdef", "../ck-20240101T000000-abcdef"],
)
def test_not_checkpoint_ids(text: str) -> None:
    assert not is_checkpoint_id(text)


def test_a_trailing_newline_is_not_a_checkpoint_id() -> None:
    assert not is_checkpoint_id("ck-20240101T000000-abcdef\n")


def test_caller_is_root() -> None:
    assert ROOT.is_root
    assert not Caller(uid=1000).is_root
