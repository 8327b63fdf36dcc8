"""``ckptctl asides``: the copies restores kept aside (``<path>.ckptd-<restore id>``) of the
files checkpoints captured, listed and, with ``--remove``, removed.

Only what a restore recorded is shown or removed (``ListAsides``: the record of each copy it
made, with its identity and owner), and only while the name still holds that very file: a
file someone else put there under a name like an aside's is never touched, whoever runs
this (root included). It runs in the caller's process with the caller's rights (a user
removes only its own copies; root's copies of a root job need root), paths as the caller
sees them, and reaches every file fd-relative with no link followed
(``adapters.procfs.safefs``), so that a path a user swapped for a link never redirects a root
caller. Names are printed quoted when they hold a newline or another control character
(``render.shown_path``). The daemon removes the oldest copies itself after each restore
(``aside_keep``, ``aside_max_age_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from ckptd._gen.ckptd.v1 import ckptd_pb2 as pb
from ckptd.adapters.procfs.asides import CHANGED, GONE, THERE, examine, remove_recorded
from ckptd.adapters.procfs.safefs import Root, UnsafePath
from ckptd.transport.cli.render import shown_path

EXIT_REFUSED = 1


def _why_not(exc: OSError) -> str:
    return " ".join(str(exc.strerror or exc).split())


def run(client: Any, args: argparse.Namespace, as_json: bool, timeout: float | None) -> int:
    recorded = client.ListAsides(pb.ListAsidesRequest(checkpoint_id=args.id or ""),
                                 timeout=timeout).asides
    me = os.geteuid()
    rows: list[dict[str, Any]] = []
    removed: list[str] = []
    problems: list[str] = []
    refused: list[str] = []
    root = Root.node()
    try:
        for aside in recorded:
            if aside.in_container:
                problems.append(f"{shown_path(aside.path)}: kept in a container's files (the "
                                "path as the container saw it): not reached from here")
                continue
            try:
                found = examine(root, aside.path, aside.dev, aside.ino, aside.uid)
            except (UnsafePath, OSError) as exc:
                problems.append(f"{shown_path(aside.path)}: {_why_not(exc)}")
                continue
            if found.state == GONE:  # removed since, by the daemon's retention or by hand
                continue
            rows.append({"path": aside.path, "size": found.st.st_size if found.st else 0,
                         "made": aside.made, "uid": aside.uid, "restore_id": aside.restore_id,
                         "checkpoint_id": aside.checkpoint_id, "state": found.state})
            if not args.remove:
                continue
            if found.state == CHANGED:
                refused.append(f"{shown_path(aside.path)}: another file than the copy restore "
                               f"{aside.restore_id} kept has its name now: left alone")
                continue
            if me not in (0, aside.uid):
                refused.append(f"{shown_path(aside.path)}: the copy is uid {aside.uid}'s: only "
                               "its owner (or root) removes it")
                continue
            try:
                why = remove_recorded(root, aside.path, aside.dev, aside.ino, aside.uid)
            except (UnsafePath, OSError) as exc:
                why = _why_not(exc)
            if why:
                refused.append(f"{shown_path(aside.path)}: {why}")
            else:
                removed.append(aside.path)
    finally:
        root.close()
    if as_json:
        print(json.dumps({"asides": rows, "removed": removed,
                          "problems": problems + refused}, indent=2))
    else:
        now = time.time()
        for row in rows:
            if row["path"] in removed:
                state = "removed"
            elif row["state"] == THERE:
                state = f"{(now - row['made']) / 3600:.1f} h old"
            else:
                state = "another file has its name now: not the copy kept"
            print(f"{shown_path(row['path'])}  {row['size']} B  {state}")
        if not rows:
            print("no copies kept aside")
        for problem in problems:
            print(f"not read: {problem}", file=sys.stderr)
        for line in refused:
            print(f"not removed: {line}", file=sys.stderr)
    return EXIT_REFUSED if refused else 0
