"""The text forms every layer checks — checkpoint ids, names, durations — with no imports.

They live outside :mod:`ckptd.domain` (whose package imports every value type, ~25 ms) so that
``ckptctl`` checks its arguments without importing the domain (issue 25, the small job).
:mod:`ckptd.domain.model` and :mod:`ckptd.domain.policy` re-export them under the same names;
:mod:`ckptd.transport.validate` builds its messages on them.
"""

from __future__ import annotations

import re

_ID_RE = re.compile(r"^ck-[0-9]{8}T[0-9]{6}-[0-9a-f]{6}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)?$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def is_checkpoint_id(text: str) -> bool:
    """``ck-<UTC YYYYMMDDTHHMMSS>-<6 hex>``, never all digits (so a pid is never an id)."""
    return bool(_ID_RE.fullmatch(text))


def valid_name(name: str) -> bool:
    """A checkpoint's or job's name: 1-128 of ``A-Za-z0-9._:@+-``, not starting with a sign."""
    return bool(_NAME.match(name))


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``2h``, ``1d``, ``500ms`` -> seconds; ValueError otherwise."""
    m = _DURATION.match(text.strip())
    if not m:
        raise ValueError(f"invalid duration {text!r}: use e.g. 30s, 15m, 2h")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]
