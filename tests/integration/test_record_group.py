"""``RecordGroup`` with a bad group record: INVALID_ARGUMENT naming the field; never
INTERNAL, and nothing recorded."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb
from ckptd.client import Daemon as Client

from .support import Daemon

pytestmark = pytest.mark.integration

NODE = "node-rg"
UNKNOWN_ID = "ck-20000101T000000-abcdef"
GOOD_ID = "g-20000101T000000-abcdef"


def member(ck: str = UNKNOWN_ID, node: str = "elsewhere") -> pb.GroupMember:
    return pb.GroupMember(node=node, address="elsewhere:7443", checkpoint_id=ck, pid=42)


BAD = [
    ("dot-dot id", pb.Group(id="../../x", members=[member()]), "invalid group id"),
    ("slash id", pb.Group(id="a/b", members=[member()]), "invalid group id"),
    ("empty id", pb.Group(id="", members=[member()]), "invalid group id"),
    ("newline id", pb.Group(id="g\n1", members=[member()]), "invalid group id"),
    ("bad member id", pb.Group(id=GOOD_ID, members=[member("ck-../../x")]),
     "invalid group member checkpoint id"),
    ("no members", pb.Group(id=GOOD_ID), "no member"),
]


@pytest.mark.parametrize(("group", "needle"), [(g, n) for _, g, n in BAD],
                         ids=[c for c, _, _ in BAD])
def test_a_bad_group_record_is_invalid_argument(
    start_daemon: Callable[..., Daemon], group: pb.Group, needle: str
) -> None:
    d = start_daemon(config={"node": NODE})
    with Client(str(d.socket)) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.stub.RecordGroup(group, timeout=30)
        err = info.value
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
        assert needle in err.details() and "\n" not in err.details(), err.details()
        assert client.stub.ListGroups(pb.ListGroupsRequest(), timeout=30).groups == []
