"""``ckptctl asides``: the copies restores kept aside (``<path>.ckptd-<restore id>``) of the
files checkpoints captured, listed and, with ``--remove``, removed.

It runs in the caller's process with the caller's rights (a user removes only what it may;
root's copies of a root job need root), paths as the caller sees them, and reaches every file
fd-relative with no link followed (``adapters.procfs.safefs``), so that a path a user swapped
for a link never redirects a root caller. The daemon removes the oldest copies itself after
each restore (``aside_keep``, ``aside_max_age_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb
from ckptd.adapters.procfs.asides import Aside, list_asides, remove_aside
from ckptd.adapters.procfs.safefs import Root, UnsafePath
from ckptd.transport.cli import convert


def captured_paths(client: Any, checkpoint_id: str | None, timeout: float | None) -> list[str]:
    """The paths of the files the caller's checkpoints (or one) captured."""
    if checkpoint_id:
        ids = [checkpoint_id]
    else:
        ids = [c["id"] for c in convert.checkpoints_to_list(
            client.List(pb.ListRequest(), timeout=timeout))]
    paths: dict[str, None] = {}
    for ck in ids:
        record = convert.checkpoint_to_dict(client.Get(pb.GetRequest(id=ck), timeout=timeout))
        paths.update(dict.fromkeys(f["path"] for f in record.get("files", ())))
    return list(paths)


def find(paths: list[str]) -> tuple[list[Aside], list[str]]:
    """Every aside of ``paths`` (the caller's own unless root), and what could not be read."""
    owner = None if os.geteuid() == 0 else os.geteuid()
    found: list[Aside] = []
    problems: list[str] = []
    root = Root.node()
    try:
        for path in paths:
            try:
                found += list_asides(root, path, owner)
            except (UnsafePath, OSError) as exc:
                problems.append(f"{path}: {exc.strerror or exc}")
    finally:
        root.close()
    return found, problems


def remove(asides: list[Aside]) -> list[str]:
    owner = None if os.geteuid() == 0 else os.geteuid()
    removed: list[str] = []
    root = Root.node()
    try:
        for aside in asides:
            if remove_aside(root, aside.path, owner):
                removed.append(aside.path)
    finally:
        root.close()
    return removed


def run(client: Any, args: argparse.Namespace, as_json: bool, timeout: float | None) -> int:
    found, problems = find(captured_paths(client, args.id, timeout))
    removed = remove(found) if args.remove else []
    if as_json:
        print(json.dumps({
            "asides": [{"path": a.path, "size": a.size, "made": a.made, "uid": a.uid}
                       for a in found],
            "removed": removed, "problems": problems}, indent=2))
    else:
        now = time.time()
        for a in found:
            state = "removed" if a.path in removed else f"{(now - a.made) / 3600:.1f} h old"
            print(f"{a.path}  {a.size} B  {state}")
        if not found:
            print("no copies kept aside")
        for problem in problems:
            print(f"not read: {problem}", file=sys.stderr)
    return 0
