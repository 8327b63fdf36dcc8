"""``PolicyRepo`` as one JSON file in the state directory, replaced atomically."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from ckptd.domain import Policy


class JsonPolicyRepo:
    def __init__(self, path: Path) -> None:
        self._path = path

    def load(self) -> list[Policy]:
        try:
            data = json.loads(self._path.read_text())
        except FileNotFoundError:
            return []
        return [Policy.from_json(p) for p in data.get("policies", [])]

    def save(self, policies: Sequence[Policy]) -> None:
        tmp = self._path.with_name(f".{self._path.name}.tmp")
        payload = json.dumps({"format": 1, "policies": [p.to_json() for p in policies]},
                             indent=1)
        with open(tmp, "w") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self._path)
        fd = os.open(self._path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
