"""The one set of rules every input from a caller is checked against, at the edge.

Both edges use these functions and nothing else: the CLI (``ckptctl``, as argparse types and
before it builds a request) and the gRPC servicer (on every request message, whatever client
sent it). The core trusts the domain values they produce: a name is a name, a count is in
range, a duration is finite.

Invariants:

- every function returns the (normalized) value or raises :class:`BadRequest`, whose one-line
  message names the field, shows the bad value shortened (never more than ``SHOWN`` chars, so
  a 10 KB name gives a short line; control characters escaped) and says what is accepted;
- names, ids, labels, kinds and paths never hold NUL, newlines or other control characters;
- numbers are finite and inside stated bounds (``0`` for a count means "all", documented in
  the message); nothing is clamped silently.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

from ckptd.errors import BadRequest
from ckptd.textforms import is_checkpoint_id, valid_name
from ckptd.textforms import parse_duration as _parse_duration

SHOWN = 40
"""At most this many characters of a bad value appear in a message."""
MAX_PID = 2**31 - 1
"""Pids travel as int32; Linux's pid_max is at most 2**22."""
MAX_KEEP = 100_000
"""Largest retention count (``--keep``, ``--keep-last``); 0 keeps all."""
MAX_DURATION_S = 366 * 86400.0
"""Longest period or timeout taken (a year): beyond it a value is a typo or an attack."""
MAX_LABELS = 64
MAX_LABEL_VALUE = 256
MAX_PATH = 4096
"""PATH_MAX, with the terminating NUL counted by the kernel."""
MAX_BACKLOG = 10_000
MAX_KINDS = 32
MAX_NAMES = 1024
MAX_FILES_DIRS = 16
NAME_RULE = "letters, digits and . _ : @ + -, starting with a letter or digit, at most 128"

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,127}$")
_KIND = re.compile(r"^[a-z][a-z0-9._-]{0,63}$")
_GPU_UUID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,95}$")
_HOST = re.compile(r"^[A-Za-z0-9._-]{1,253}$")
_PORT = re.compile(r"^[0-9]{1,5}$")


def shown(value: object) -> str:
    """``value`` as a message shows it: repr, escaped, cut to ``SHOWN`` characters."""
    text = repr(value)
    if len(text) <= SHOWN:
        return text
    size = f" ({len(value)} chars)" if isinstance(value, str | bytes) else ""
    return f"{text[:SHOWN]}...{size}"


def _bad(field: str, value: object, rule: str) -> BadRequest:
    return BadRequest(f"invalid {field} {shown(value)}: {rule}", field=field, hint="")


# ---- names and ids ---------------------------------------------------------------------------


def name(value: str, field: str = "name", *, required: bool = False) -> str:
    """A checkpoint's or job's name (``""`` when not ``required``: none)."""
    if value == "" and not required:
        return value
    if not valid_name(value):
        raise _bad(field, value, f"use {NAME_RULE}")
    return value


def names(values: Iterable[str], field: str = "name") -> tuple[str, ...]:
    out = tuple(values)
    if len(out) > MAX_NAMES:
        raise BadRequest(f"too many {field}s ({len(out)}): at most {MAX_NAMES}", field=field)
    return tuple(name(v, field, required=True) for v in out)


def checkpoint_id(value: str, field: str = "checkpoint id", *, required: bool = True) -> str:
    """A checkpoint id, ``ck-YYYYMMDDTHHMMSS-xxxxxx`` (``""`` when not ``required``)."""
    if value == "" and not required:
        return value
    if not is_checkpoint_id(value):
        raise _bad(field, value, "a checkpoint id looks like ck-20250101T120000-abcdef "
                   "(see `ckptctl list`)")
    return value


def group_id(value: str) -> str:
    return name(value, "group id", required=True)


# ---- numbers ---------------------------------------------------------------------------------


def pid(value: int, field: str = "pid", *, required: bool = True) -> int:
    """A process id: 1..2**31-1 (0 when not ``required``: none)."""
    if value == 0 and not required:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_PID:
        raise _bad(field, value, "a pid is a positive whole number")
    return value


def parse_pid(text: str, field: str = "pid") -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 10:
        raise _bad(field, text, "a pid is a positive whole number")
    return pid(int(text), field)


def count(value: int, field: str = "keep", *, limit: int = MAX_KEEP) -> int:
    """A retention count: 0 (keep all) .. ``limit``. Negative values are refused, never
    taken as "all"."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise _bad(field, value, f"give a whole number from 1 to {limit} (0: keep all)")
    return value


def parse_count(text: str, field: str = "keep", *, limit: int = MAX_KEEP) -> int:
    """A count typed on a command line: digits only, 1..``limit``."""
    if not (text.isascii() and text.isdigit()) or len(text) > 12 or not 0 < int(text) <= limit:
        raise _bad(field, text, f"give a whole number from 1 to {limit}")
    return int(text)


def duration(value: float, field: str = "period", *, minimum: float = 0.0,
             maximum: float = MAX_DURATION_S, optional: bool = True) -> float:
    """Seconds: finite, ``minimum``..``maximum`` (0 when ``optional``: none). NaN, inf and
    negatives are refused."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(field, value, "give a number of seconds")
    if value == 0 and optional:
        return 0.0
    if not math.isfinite(value) or value <= 0:
        raise _bad(field, value, "give a positive, finite number of seconds")
    if value < minimum:
        raise _bad(field, value, f"at least {minimum:g}s")
    if value > maximum:
        raise _bad(field, value, f"at most {maximum:g}s ({maximum / 86400:g} days)")
    return float(value)


def parse_duration(text: str, field: str = "period", *, minimum: float = 0.0,
                   maximum: float = MAX_DURATION_S) -> float:
    """``90``, ``90s``, ``15m``, ``2h``, ``1d``, ``500ms`` -> seconds in range."""
    try:
        seconds = _parse_duration(text) if len(text) <= 32 else math.nan
    except ValueError:
        raise _bad(field, text, "use e.g. 30s, 15m, 2h") from None
    return duration(seconds, field, minimum=minimum, maximum=maximum, optional=False)


def backlog(value: int) -> int:
    if not 0 <= value <= MAX_BACKLOG:
        raise _bad("backlog", value, f"from 0 to {MAX_BACKLOG}")
    return value


# ---- text ------------------------------------------------------------------------------------


def _plain(value: str, field: str, *, limit: int) -> str:
    if _CONTROL.search(value):
        raise _bad(field, value, "control characters (NUL, newline, ...) are not allowed")
    if len(value.encode()) > limit:
        raise _bad(field, value, f"at most {limit} bytes")
    return value


def labels(values: Mapping[str, str], field: str = "label") -> dict[str, str]:
    """At most ``MAX_LABELS``; keys like names (``/`` allowed), values plain text."""
    if len(values) > MAX_LABELS:
        raise BadRequest(f"too many {field}s ({len(values)}): at most {MAX_LABELS}",
                         field=field)
    for key, value in values.items():
        if not _LABEL_KEY.fullmatch(key):
            raise _bad(f"{field} key", key, f"use {NAME_RULE} (and /)")
        _plain(value, f"{field} value", limit=MAX_LABEL_VALUE)
    return dict(values)


def parse_label(text: str, field: str = "label") -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep:
        raise _bad(field, text, "expected KEY=VALUE")
    labels({key: value}, field)
    return key, value


def gpu_map(values: Mapping[str, str]) -> dict[str, str]:
    if len(values) > MAX_LABELS:
        raise BadRequest(f"too many GPUs in the GPU map ({len(values)})", field="gpu map")
    for key, value in values.items():
        for part in (key, value):
            if not _GPU_UUID.fullmatch(part):
                raise _bad("GPU UUID", part, "a GPU UUID looks like GPU-8c5c0a2e-... "
                           "(`nvidia-smi -L`)")
    return dict(values)


def kinds(values: Iterable[str]) -> tuple[str, ...]:
    out = tuple(values)
    if len(out) > MAX_KINDS:
        raise BadRequest(f"too many event kinds ({len(out)}): at most {MAX_KINDS}",
                         field="kind")
    for kind in out:
        if not _KIND.fullmatch(kind):
            raise _bad("event kind", kind, "e.g. checkpoint or policy.fired")
    return out


def path(value: str, field: str = "--output", *, required: bool = False) -> str:
    """An absolute path the daemon will open for the caller: no control characters, at most
    PATH_MAX, no ``..`` component (``""`` when not ``required``). Whether its parent exists
    and what it is are checked where it is opened (``adapters.procfs.stdio``)."""
    if value == "" and not required:
        return value
    _plain(value, field, limit=MAX_PATH - 1)
    if not value.startswith("/"):
        raise _bad(field, value, "give an absolute path")
    if ".." in value.split("/"):
        raise _bad(field, value, "a path with '..' is not taken; give it resolved")
    if value.endswith("/"):
        raise _bad(field, value, "give a file's path, not a directory's")
    return value


def files_dirs(values: Iterable[str], field: str = "--files") -> tuple[str, ...]:
    """Output directories (``--files DIR``): at most ``MAX_FILES_DIRS`` absolute paths, no
    ``.``/``..`` component, none the file system's root; normalised (no trailing or double
    slash) and deduplicated, in the order given."""
    found: list[str] = []
    for value in values:
        _plain(value, field, limit=MAX_PATH - 1)
        if not value.startswith("/"):
            raise _bad(field, value, "give an absolute directory path")
        parts = [p for p in value.split("/") if p]
        if "." in parts or ".." in parts:
            raise _bad(field, value, "a path with '.' or '..' is not taken; give it resolved")
        if not parts:
            raise _bad(field, value, "give the job's output directory, not /")
        normal = "/" + "/".join(parts)
        if normal not in found:
            found.append(normal)
    if len(found) > MAX_FILES_DIRS:
        raise BadRequest(f"{len(found)} {field} directories given; at most {MAX_FILES_DIRS}",
                         field=field)
    return tuple(found)


def cgroup(value: str, *, required: bool = False) -> str:
    """A cgroup v2 path as /proc/PID/cgroup shows it (``""`` when not ``required``)."""
    if value == "" and not required:
        return value
    _plain(value, "cgroup", limit=MAX_PATH - 1)
    parts = value.split("/")
    if not value.startswith("/") or ".." in parts or "." in parts:
        raise _bad("cgroup", value, "give a cgroup v2 path such as /system.slice/job.scope")
    return value


def address(value: str, field: str = "address", *, listen: bool = False) -> str:
    """``host:port`` (``[v6]:port`` too): a host name or address, a port 1..65535. A
    ``listen`` address may leave the host out (all interfaces) and give port 0 (any free)."""
    if _CONTROL.search(value) or len(value) > 300:
        raise _bad(field, value, "expected HOST:PORT")
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        inner = host[1:-1]
        ok_host = bool(inner) and all(c in "0123456789abcdefABCDEF:." for c in inner)
    else:
        ok_host = bool(_HOST.fullmatch(host)) or (listen and host == "")
    if not sep or not ok_host or not _PORT.fullmatch(port):
        raise _bad(field, value, "expected HOST:PORT, e.g. node2:7411")
    lowest = 0 if listen else 1
    if not lowest <= int(port) <= 65535:
        raise _bad(field, value, f"port {port} is out of range ({lowest} to 65535)")
    return value
