"""Human formatting for ``ckptctl``: sizes, durations, times, tables and report blocks.

Everything here is pure (strings in, strings out) except :class:`ProgressLine`, which writes a
single self-overwriting status line to a terminal.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from ckptd.transport.cli import lazy

if TYPE_CHECKING:
    import datetime as _dt
    import shutil
else:  # imported on first use: a small dump's output needs neither (issue 35)
    _dt = lazy.module("datetime")
    shutil = lazy.module("shutil")

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def human_bytes(n: int) -> str:
    """``1536`` -> ``1.5 KiB``; bytes below 1 KiB are shown exactly (``512 B``)."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in _UNITS[1:]:
        value /= 1024.0
        if value < 1024.0 or unit == _UNITS[-1]:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def shown_path(path: str) -> str:
    """A path for a line of human output: as it is when every character prints and none is a
    quote or backslash, else quoted like a Python string (``'a\\nb'``: a newline, an escape
    sequence or a byte that is no UTF-8 never reaches the terminal raw)."""
    if path.isprintable() and not any(c in path for c in "'\"\\"):
        return path
    return repr(path)


def escaped(text: str) -> str:
    """``text`` with every character that does not print (a newline, a terminal escape
    sequence, a byte that is no UTF-8) written as its escape (``\\n``, ``\\x1b``), for
    text a line of human output carries from elsewhere (an event's message naming files)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def seconds(value: float) -> str:
    """A duration in seconds with two decimals, without the unit: ``1.234`` -> ``1.23``."""
    return f"{value:.2f}"


def ratio(numerator: int, denominator: int) -> str | None:
    """``numerator / denominator`` as ``4.00x``; ``None`` when either side is zero."""
    if numerator <= 0 or denominator <= 0:
        return None
    return f"{numerator / denominator:.2f}x"


def parse_iso(text: str | None) -> _dt.datetime | None:
    """An RFC 3339 / ISO 8601 string (``...Z`` accepted) as an aware datetime."""
    if not text:
        return None
    try:
        return _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def local_time(iso: str | None) -> str:
    """An ISO 8601 timestamp in local time, ``YYYY-MM-DD HH:MM:SS``; ``-`` when unknown."""
    when = parse_iso(iso)
    if when is None:
        return "-"
    return when.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def dash(text: object) -> str:
    """``text`` as a string, ``-`` when empty."""
    value = str(text) if text is not None else ""
    return value if value else "-"


def yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def labels_text(labels: Mapping[str, str]) -> str:
    """``{"b": "2", "a": "1"}`` -> ``a=1, b=2``; ``-`` when there are none."""
    if not labels:
        return "-"
    return ", ".join(f"{key}={labels[key]}" for key in sorted(labels))


def table(
    headers: Sequence[str],
    rows: Iterable[Sequence[str]],
    indent: str = "",
    *,
    show_header: bool = True,
) -> str:
    """Left-aligned columns separated by two spaces; the last column is not padded.

    ``headers`` always sets the number of columns (and their minimum widths when shown)."""
    body = [list(row) for row in rows]
    all_rows = [list(headers), *body] if show_header else body
    if not all_rows:
        return ""
    widths = [max(len(row[i]) for row in all_rows) for i in range(len(headers))]
    lines = []
    for row in all_rows:
        cells = [cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])]
        cells.append(row[-1])
        lines.append((indent + "  ".join(cells)).rstrip())
    return "\n".join(lines)


def key_values(pairs: Sequence[tuple[str, str]]) -> str:
    """``key: value`` lines with the values aligned."""
    if not pairs:
        return ""
    width = max(len(key) for key, _ in pairs) + 1
    return "\n".join(f"{(key + ':').ljust(width)} {value}".rstrip() for key, value in pairs)


# --------------------------------------------------------------------------------------------
# Commands' human output. Inputs are the JSON-able dicts made by ``convert``.


def dump_summary(ck: Mapping[str, Any]) -> str:
    """The dump's one line, then what it did not capture (files over the capture limit,
    locks a restore drops), one line each as ``show`` says them."""
    lines = [
        f"checkpoint {ck['id']} of pid {ck['pid']}: {human_bytes(ck['bytes_logical'])} of "
        f"images, {human_bytes(ck['bytes'])} stored, {human_bytes(ck['bytes_new'])} new, "
        f"in {seconds(ck['duration_s'])}s (frozen {seconds(ck['frozen_s'])}s)"
    ]
    lines.extend(f"file not captured: {skipped}" for skipped in ck.get("files_skipped") or [])
    return "\n".join(lines)


def verify_report(report: Mapping[str, Any]) -> str:
    checked = report.get("checked") or []
    lines = [f"checked {len(checked)} checkpoint(s), {report.get('packs_checked', 0)} pack(s)"]
    problems = report.get("problems") or []
    if not problems:
        lines.append("all good: every page and image matches its hash")
    else:
        lines.append(f"{len(problems)} problem(s):")
        lines.extend(f"  BAD  {p}" for p in problems)
    return "\n".join(lines)


def gc_report(report: Mapping[str, Any]) -> str:
    deleted = report.get("deleted_checkpoints") or []
    lines = []
    if deleted:
        lines.append(f"deleted {len(deleted)} checkpoint(s) beyond retention: {', '.join(deleted)}")
    lines.append(
        f"freed {human_bytes(int(report.get('bytes_freed', 0)))}: "
        f"{report.get('packs_deleted', 0)} pack(s), {report.get('blobs_deleted', 0)} blob(s); "
        f"kept {report.get('packs_kept', 0)} pack(s), "
        f"{human_bytes(int(report.get('bytes_kept', 0)))}"
    )
    lines.extend(str(line) for line in report.get("skipped") or ())
    if int(report.get("packs_rewritten", 0)):
        lines.append(
            f"compacted {report['packs_rewritten']} pack(s), "
            f"{human_bytes(int(report.get('bytes_rewritten', 0)))}, into "
            f"{report.get('packs_written', 0)} pack(s), "
            f"{human_bytes(int(report.get('bytes_written', 0)))}"
        )
    if int(report.get("bytes_condemned", 0)):
        lines.append(
            f"condemned {human_bytes(int(report['bytes_condemned']))}: no checkpoint needs "
            "it, freed once gc_grace_s has passed"
        )
    pinned = report.get("pinned") or []
    if pinned:
        lines.append("pinned by checkpoint (its packs; of those, only it needs):")
        lines.extend(
            f"  {p.get('checkpoint_id', '')}  {human_bytes(int(p.get('bytes', 0)))} in "
            f"{p.get('packs', 0)} pack(s); {human_bytes(int(p.get('bytes_alone', 0)))}"
            for p in pinned
        )
    return "\n".join(lines)


def restore_summary(result: Mapping[str, Any]) -> str:
    line = f"restored {result['id']} as pid {result['pid']} in {seconds(result['duration_s'])}s"
    if result.get("lazy"):
        line += (" (lazy: its memory comes in as it runs; `ckptctl events` says "
                 "restore.lazy_done when all is in)")
    if result.get("output_path"):
        line += f"\noutput: {result['output_path']}"
    for path in result.get("files_put_back", ()):
        line += f"\nput back: {shown_path(path)} (as at the checkpoint)"
    for path in result.get("files_kept", ()):
        line += f"\nkept: {shown_path(path)} (the version found on disk)"
    for left in result.get("files_left", ()):
        line += (f"\nleft as found: {shown_path(left)}, a process outside the checkpoint "
                 "(not rolled back: shared_files = keep)")
    return line


def migrate_summary(result: Mapping[str, Any]) -> str:
    node = result.get("node") or result.get("address")
    line = (
        f"migrated to {node} ({result.get('address')}) as pid {result.get('pid')} "
        f"from {result.get('checkpoint_id')}: down {seconds(result.get('downtime_s', 0.0))}s "
        f"(frozen {seconds(result.get('frozen_s', 0.0))}s)"
    )
    if result.get("shared_store"):
        line += "\nshared store: no pages sent"
    else:
        line += (
            f"\nsent {result.get('pages_sent', 0)} of {result.get('pages_total', 0)} pages, "
            f"{human_bytes(int(result.get('bytes_sent', 0)))} in "
            f"{seconds(result.get('transfer_s', 0.0))}s"
        )
    if result.get("output_path"):
        line += f"\noutput on the target: {result['output_path']}"
    return line


def checkpoint_table(checkpoints: Sequence[Mapping[str, Any]]) -> str:
    rows = [
        [
            str(ck["id"]),
            str(ck["pid"]),
            dash(ck["name"]),
            local_time(ck["created"]),
            age(ck["created"]),
            human_bytes(ck["bytes"]),
            human_bytes(ck["bytes_new"]),
            dash(ck["node"]),
        ]
        for ck in checkpoints
    ]
    return table(["ID", "PID", "NAME", "CREATED", "AGE", "SIZE", "NEW", "NODE"], rows)


def age(iso: str | None, now: _dt.datetime | None = None) -> str:
    """How long ago: ``45s``, ``12m``, ``3h``, ``2d``; ``-`` when unknown."""
    then = parse_iso(iso)
    if then is None:
        return "-"
    now = now or _dt.datetime.now(_dt.UTC)
    seconds = max(0, int((now - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _size(n: int) -> str:
    return f"{human_bytes(n)} ({n} bytes)" if n >= 1024 else human_bytes(n)


def checkpoint_details(ck: Mapping[str, Any]) -> str:
    created = ck["created"]
    created_text = f"{local_time(created)} ({created})" if created else "-"
    pairs: list[tuple[str, str]] = [
        ("id", str(ck["id"])),
        ("pid", str(ck["pid"])),
        ("name", dash(ck["name"])),
        ("labels", labels_text(ck["labels"])),
        ("created", created_text),
        ("node", dash(ck["node"])),
        ("uid", str(ck["uid"])),
        ("leave running", yes_no(ck["leave_running"])),
        ("logical size", _size(ck["bytes_logical"])),
        ("stored size", _size(ck["bytes"])),
        ("new size", _size(ck["bytes_new"])),
    ]
    compression = ratio(ck["bytes_logical"], ck["bytes"])
    if compression:
        pairs.append(("compression",
                      f"{compression} (logical/stored: compressed frames and zero pages)"))
    dedup = ratio(ck["bytes"], ck["bytes_new"])
    if dedup:
        pairs.append(("dedup", f"{dedup} (stored/new: shared with earlier checkpoints)"))
    pairs += [
        ("frozen", f"{seconds(ck['frozen_s'])}s"),
        ("total", f"{seconds(ck['duration_s'])}s"),
        ("criu version", dash(ck["criu_version"])),
        ("parent", dash(ck["parent_id"])),
    ]
    tcp = int(ck.get("tcp_connections") or 0)
    if tcp:
        how = "restored closed" if ck.get("tcp_close") else "restored established"
        pairs.append(("tcp connections", f"{tcp} ({how})"))
    if ck.get("container"):
        limit = int(ck.get("container_memory_limit") or 0)
        pairs.append(("container", "yes: dumped inside it, pids of its namespace (NS PID)"
                      + (f"; memory limit {limit >> 20} MiB" if limit else "")))
    out = [key_values(pairs)]

    processes = ck["processes"]
    if processes:
        out.append(f"processes ({len(processes)}):")
        out.append(
            table(
                ["PID", "PPID", "COMM", "CMDLINE"],
                (
                    [_pid_cell(p), str(p["ppid"]), dash(p["comm"]), dash(" ".join(p["cmdline"]))]
                    for p in processes
                ),
                indent="  ",
            )
        )
    else:
        out.append("processes: -")

    stdio = ck["stdio"]
    if stdio:
        out.append(f"stdio ({len(stdio)}):")
        out.append(
            table(
                ["PID", "FD", "KIND", "TARGET", "", "ON RESTORE"],
                (
                    [
                        str(s["pid"]),
                        str(s["fd"]),
                        dash(s["kind"]),
                        dash(s["target"]),
                        "->",
                        dash(s["on_restore"]),
                    ]
                    for s in stdio
                ),
                indent="  ",
            )
        )
    else:
        out.append("stdio: -")
    files = ck.get("files") or []
    if files:
        total = sum(int(f["size"]) for f in files)
        out.append(f"files captured ({len(files)}, {human_bytes(total)}): put back by a restore")
        out.append(table(["SIZE", "PATH"],
                         ([human_bytes(int(f["size"])), f["path"]] for f in files), indent="  "))
        for f in files:
            if f.get("writers"):
                out.append(f"file {shown_path(f['path'])} also written by "
                           f"{shown_path(', '.join(f['writers']))}, outside the tree, at the "
                           "checkpoint (a restore leaves it as it is while such a process "
                           "writes it: shared_files)")
    for skipped in ck.get("files_skipped") or []:
        out.append(f"file not captured: {skipped}")
    out.extend(_fingerprint(ck.get("fingerprint")))
    out.extend(_gpu_facts(ck.get("gpu")))
    return "\n".join(out)


def _fingerprint(fp: Mapping[str, Any] | None) -> list[str]:
    """The node a checkpoint was made on, and how many paths it needs of a node."""
    if not fp:
        return []  # made before fingerprints were recorded
    dirs, mounts = fp["directories"], fp["mounts"]
    pairs = [
        ("arch", dash(fp["arch"])),
        ("cpu model", f"{dash(fp['cpu_model'])} ({fp['cpu_flags']} flags)"),
        ("kernel", dash(fp["kernel"])),
        ("libc", dash(fp["libc"])),
        (
            "files needed",
            f"{fp['files']} (+ {dirs} working director{'y' if dirs == 1 else 'ies'}, "
            f"{mounts} mount point{'' if mounts == 1 else 's'})",
        ),
    ]
    return ["node fingerprint:", *("  " + line for line in key_values(pairs).splitlines())]


def compat_report(report: Mapping[str, Any]) -> str:
    """``ckptctl check-restore``: "compatible", or every blocking difference and warning;
    then what a restore would change on the way (files it puts back)."""
    notes = [f"  - {line}" for line in report.get("notes") or []]
    if notes:
        notes.insert(0, f"a restore also ({len(notes)}):")
    if report["compatible"]:
        return "\n".join(["compatible", *notes])
    out = []
    if report["blocking"]:
        out.append(f"blocking ({len(report['blocking'])}): a restore is refused")
        out.extend(f"  - {line}" for line in report["blocking"])
    if report["warnings"]:
        out.append(
            f"warnings ({len(report['warnings'])}): a restore is refused unless "
            "--ignore-warnings"
        )
        out.extend(f"  - {line}" for line in report["warnings"])
    return "\n".join(out + notes)


def _cuda(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}" if version else "-"


def _pid_cell(proc: Mapping[str, Any]) -> str:
    """The node pid, and the pid inside the job's own pid namespace when it has one."""
    return f"{proc['pid']} (ns {proc['ns_pid']})" if proc.get("ns_pid") else str(proc["pid"])


def _gpu_facts(gpu: Mapping[str, Any] | None) -> list[str]:
    """The GPU part of ``show``: nothing for a checkpoint without CUDA processes."""
    if not gpu or not gpu.get("cuda_pids"):
        return []
    out = [
        f"gpu: driver {dash(gpu['driver_version'])}, CUDA {_cuda(gpu['cuda_version'])}; "
        f"cuda pids {', '.join(str(p) for p in gpu['cuda_pids'])}",
        f"  times: lock {seconds(gpu['lock_s'])}s, checkpoint {seconds(gpu['checkpoint_s'])}s, "
        f"restore {seconds(gpu['restore_s'])}s, unlock {seconds(gpu['unlock_s'])}s",
    ]
    names = {g["uuid"]: g for g in gpu.get("gpus") or []}
    uses = gpu.get("uses") or []
    if uses:
        out.append(
            table(
                ["PID", "GPU", "MODEL", "MEMORY"],
                (
                    [
                        str(u["pid"]),
                        dash(u["uuid"]),
                        dash(names.get(u["uuid"], {}).get("name", "")),
                        human_bytes(int(u["memory"])),
                    ]
                    for u in uses
                ),
                indent="  ",
            )
        )
    return out


def check_report(report: Mapping[str, Any]) -> str:
    criu_state = "ok" if report["criu_ok"] else "NOT OK"
    criu_line = " ".join(
        part
        for part in (dash(report["criu_path"]), report["criu_version"], f"({criu_state})")
        if part
    )
    pairs: list[tuple[str, str]] = [
        ("node", dash(report["node"])),
        ("kernel", dash(report["kernel"])),
        ("daemon version", dash(report["daemon_version"])),
        ("criu", criu_line),
    ]
    if report["criu_message"]:
        pairs.append(("criu message", report["criu_message"]))
    gpus = report["gpus"]
    if report["gpu_available"]:
        gpu_text = f"available ({len(gpus)} GPU{'s' if len(gpus) != 1 else ''})"
    else:
        gpu_text = "not available"
    if report["gpu_message"]:
        gpu_text += f": {report['gpu_message']}"
    if report.get("gpu_driver"):
        gpu_text += f" (driver {report['gpu_driver']}, CUDA {_cuda(report['cuda_version'])})"
    pairs += [("gpu", gpu_text), ("store", dash(report["store"]))]
    pairs += _runtime_pairs(report)
    out = [key_values(pairs)]

    if gpus:
        out.append("gpus:")
        out.append(
            table(
                ["INDEX", "NAME", "UUID", "MEMORY", "FREE", "CC", "PCI"],
                (
                    [
                        str(g["index"]),
                        dash(g["name"]),
                        dash(g["uuid"]),
                        human_bytes(int(g["memory_total"])),
                        human_bytes(int(g.get("memory_free") or 0)),
                        dash(g.get("compute_capability", "")),
                        dash(g.get("pci_bus_id", "")),
                    ]
                    for g in gpus
                ),
                indent="  ",
            )
        )
    features = report["features"]
    if features:
        out.append("features:")
        out.append(
            table(
                ["STATE", "NAME", "DETAIL"],
                (["ok" if f["ok"] else "FAIL", dash(f["name"]), f["detail"]] for f in features),
                indent="  ",
                show_header=False,
            )
        )
    else:
        out.append("features: -")

    if not report["criu_ok"]:
        problem = report["criu_message"] or "criu check failed"
        out.append("")
        out.append(
            f"PROBLEM: CRIU is not usable on this node, so dump and restore will fail: {problem}"
        )
    warnings = report.get("warnings") or []
    if warnings:
        out.append("")
        out.extend(f"WARNING: {w}" for w in warnings)
    return "\n".join(out)


def _runtime_pairs(report: Mapping[str, Any]) -> list[tuple[str, str]]:
    """What the node gives containers; nothing from a daemon that does not report it."""
    cgroup = report.get("cgroup_hierarchy") or ""
    if not cgroup and not report.get("oci_runtimes"):
        return []
    runtimes = ", ".join(report.get("oci_runtimes") or []) or "none found"
    if report.get("podman_runtime"):
        runtimes += f" (podman's default: {report['podman_runtime']})"
    return [
        ("cgroups", dash(cgroup)),
        ("oci runtimes", runtimes),
        ("cap_sys_resource", "yes" if report.get("cap_sys_resource") else "NO"),
    ]


class ProgressLine:
    """One status line on a terminal, rewritten in place with ``\\r``.

    Writes nothing at all when ``stream`` is not a terminal (progress is for people; scripts
    get the final result only)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._enabled = _isatty(stream)
        self._width = 0

    @property
    def enabled(self) -> bool:
        return self._enabled

    def update(self, stage: str, message: str, fraction: float) -> None:
        if not self._enabled:
            return
        text = stage or "working"
        if 0.0 < fraction <= 1.0:
            filled = round(fraction * 20)
            text = f"[{'#' * filled}{'.' * (20 - filled)}] {fraction * 100:3.0f}% {text}"
        if message:
            text += f": {message}"
        text = " ".join(text.split())  # a progress line must stay one line
        columns = shutil.get_terminal_size((80, 24)).columns
        if columns > 1 and len(text) > columns - 1:
            text = text[: max(columns - 2, 1)] + "…"
        self._write("\r" + text.ljust(self._width))
        self._width = len(text)

    def clear(self) -> None:
        """Erase the line (before the final result or an error is printed)."""
        if not self._enabled or self._width == 0:
            return
        self._write("\r" + " " * self._width + "\r")
        self._width = 0

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):
            self._enabled = False


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False
