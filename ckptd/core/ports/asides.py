"""The record of the copies restores kept aside (``<path>.ckptd-<restore id>``).

A restore that put a file back and kept the version it found beside it records that copy
here: its path, its identity and owner as made, and which restore of which checkpoint made
it. ``ckptctl asides`` lists and removes only what is recorded, and only while the name still
holds that very file (``st_dev``, ``st_ino``, owner): a file someone else put at a name like
an aside's is never a copy ckptd kept, whoever runs ``ckptctl``.

Invariants: a record is written before the restore's result is given; records are forgotten
when the copy is removed (or the name holds another file); the log keeps at most a bounded
number of restores' records (the oldest forgotten: those copies are then the user's to
remove by hand, never removed by ckptd)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class AsideRecord:
    """One copy a restore kept aside."""

    path: str
    """Beside the file put back, as the restored tree saw it."""
    dev: int
    ino: int
    uid: int
    """The copy's owner when made (the file's owner)."""
    restore_id: str
    checkpoint_id: str
    owner: int
    """The checkpoint's owner: a caller of that uid may list it (root: every one)."""
    made: float
    in_container: bool = False
    """Made in a container's root file system (``path`` as the container saw it)."""

    def to_json(self) -> dict[str, object]:
        return {"path": self.path, "dev": self.dev, "ino": self.ino, "uid": self.uid,
                "restore_id": self.restore_id, "checkpoint_id": self.checkpoint_id,
                "owner": self.owner, "made": self.made, "in_container": self.in_container}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> AsideRecord:
        def whole(key: str) -> int:
            value = data.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{key} {value!r} is not a whole number")
            return value

        path, restore_id, checkpoint_id = (data.get(k) for k in
                                           ("path", "restore_id", "checkpoint_id"))
        made = data.get("made")
        if not (isinstance(path, str) and path.startswith("/") and isinstance(restore_id, str)
                and isinstance(checkpoint_id, str) and isinstance(made, int | float)):
            raise ValueError("not an aside record")
        return cls(path=path, dev=whole("dev"), ino=whole("ino"), uid=whole("uid"),
                   restore_id=restore_id, checkpoint_id=checkpoint_id, owner=whole("owner"),
                   made=float(made), in_container=data.get("in_container") is True)


class AsideLog(Protocol):
    """Durable records of the copies restores kept aside. Thread-safe."""

    def add(self, records: Sequence[AsideRecord]) -> None:
        """Record the copies one restore made (all of the same ``restore_id``), durably
        before it returns."""
        ...

    def records(self) -> tuple[AsideRecord, ...]:
        """Every copy recorded, oldest first."""
        ...

    def forget(self, records: Sequence[AsideRecord]) -> None:
        """Forget these records (their copies removed, or gone); unknown ones are ignored."""
        ...
