"""Prometheus metrics of the daemon, fed by its ``EventBus``.

Wiring: ``metrics = Metrics(store_size)``, ``bus.add_listener(metrics.on_event)``, then
``metrics.serve("host:port")`` when an HTTP endpoint is wanted (``render()`` gives the same
text without one).

Invariants:

- each ``Metrics`` owns its own ``CollectorRegistry``; nothing is ever registered in
  prometheus_client's global default registry, so several daemons (or tests) can live in one
  process;
- ``on_event`` never raises and never blocks on I/O: a field that is missing, not a number
  (bools and strings included), not finite, or negative where a count or a duration is meant,
  is ignored, and the rest of the event is still counted;
- every event, of any kind (also kinds this module does not know), counts once in
  ``ckptd_events_total{kind}``; outcome counters count each terminal event once;
- ``store_size`` is called only at scrape time (``render`` or an HTTP scrape), never from
  ``on_event``; when it fails, the two store gauges are left out of that scrape, and the rest
  is still served;
- label values stay bounded: ``ckptd_failures_total{operation, reason}`` takes the error's
  class name (letters, digits and ``_`` only, at most 64, else ``unknown``), and
  ``ckptd_job_last_checkpoint_timestamp_seconds{name}`` keeps the ``MAX_JOB_NAMES`` names
  checkpointed most recently (the oldest name's series is removed for a new one).

Prometheus adds ``instance`` and ``job`` (the scrape target's) to every series: no metric
here has a label of those names (a job is ``name``, as in ``ckptctl list``).
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ckptd.domain import Event, EventKind

log = logging.getLogger(__name__)

StoreSize = Callable[[], tuple[int, int]]
"""Returns (number of checkpoints, stored bytes) of the store; called at scrape time."""

SECONDS_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, math.inf,
)
"""Histogram buckets for durations from 10 ms to 30 min (and beyond, in +Inf)."""

MAX_JOB_NAMES = 1000
"""Names with a ``ckptd_job_last_checkpoint_timestamp_seconds`` series at most."""

FAILED_OPERATION = {EventKind.CHECKPOINT_FAILED: "checkpoint",
                    EventKind.RESTORE_FAILED: "restore", EventKind.MIGRATE_FAILED: "migration",
                    EventKind.RESTORE_LAZY_FAILED: "restore"}
_REASON = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def failure_reason(fields: Mapping[str, Any]) -> str:
    """The ``reason`` label of a failure: its ``error`` field (the exception's class name)
    when it is a plain identifier of at most 64 characters, else ``unknown``."""
    error = fields.get("error")
    return error if isinstance(error, str) and _REASON.fullmatch(error) else "unknown"


def _number(fields: Mapping[str, Any], key: str, *, non_negative: bool = True) -> float | None:
    """``fields[key]`` as a finite float, or None when absent or unusable (a bool, a string,
    NaN, infinity, or a negative value when ``non_negative``)."""
    value = fields.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    if not math.isfinite(number) or (non_negative and number < 0):
        return None
    return number


class _StoreCollector(Collector):
    """``ckptd_store_checkpoints`` and ``ckptd_store_bytes``, asked of ``store_size`` at each
    scrape (and left out of a scrape where it fails)."""

    def __init__(self, store_size: StoreSize) -> None:
        self._store_size = store_size

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily("ckptd_store_checkpoints", "Checkpoints in the store."),
            GaugeMetricFamily("ckptd_store_bytes", "Bytes stored by the store's checkpoints."),
        )

    def describe(self) -> Iterable[Metric]:
        # lets the registry check names without calling store_size at registration
        return self._families()

    def collect(self) -> Iterable[Metric]:
        try:
            count, size = self._store_size()
            count_f, size_f = float(count), float(size)
        except Exception:
            log.warning("metrics: store size unavailable", exc_info=True)
            return ()
        checkpoints, stored = self._families()
        checkpoints.add_metric([], count_f)
        stored.add_metric([], size_f)
        return (checkpoints, stored)


class MetricsServer:
    """The HTTP endpoint of one ``Metrics`` (any path answers; ``/metrics`` by convention),
    served by a daemon thread until ``stop()``.

    ``host`` and ``port`` are the bound address (``port`` is the real one when 0 was asked).
    ``stop()`` is idempotent and returns once the serving thread has ended.
    """

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self._lock = threading.Lock()
        self._stopped = False
        address = server.server_address
        self.host: str = str(address[0])
        self.port: int = int(address[1])

    def stop(self, timeout: float = 5.0) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout)


def parse_listen(listen: str) -> tuple[str, int]:
    """``"host:port"``, ``"[v6addr]:port"`` or ``":port"`` (all interfaces) to (host, port).
    Raises ValueError on anything else, or a port outside 0..65535 (0: any free port)."""
    host, sep, port_text = listen.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"metrics listen address {listen!r} is not host:port")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"metrics listen port {port} out of range")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"metrics listen address {listen!r}: write an IPv6 host as [addr]")
    return host or "0.0.0.0", port


class Metrics:
    """The daemon's Prometheus metrics, in a registry of their own (``self.registry``).

    ``on_event`` is the listener to add to the ``EventBus``; it is thread-safe (the metric
    objects are) and never raises. ``store_size`` (optional) is called at scrape time only.
    """

    def __init__(self, store_size: StoreSize | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.events = Counter(
            "ckptd_events", "Events published on the daemon's event bus.", ["kind"], registry=r
        )
        self.checkpoints = Counter(
            "ckptd_checkpoints", "Checkpoints that ended, by outcome.", ["outcome"], registry=r
        )
        self.restores = Counter(
            "ckptd_restores", "Restores that ended, by outcome.", ["outcome"], registry=r
        )
        self.migrations = Counter(
            "ckptd_migrations", "Migrations that ended, by outcome.", ["outcome"], registry=r
        )
        self.checkpoint_duration = Histogram(
            "ckptd_checkpoint_duration_seconds", "Duration of committed checkpoints.",
            registry=r, buckets=SECONDS_BUCKETS,
        )
        self.checkpoint_frozen = Histogram(
            "ckptd_checkpoint_frozen_seconds",
            "How long committed checkpoints kept their processes frozen.",
            registry=r, buckets=SECONDS_BUCKETS,
        )
        self.restore_duration = Histogram(
            "ckptd_restore_duration_seconds", "Duration of successful restores.",
            registry=r, buckets=SECONDS_BUCKETS,
        )
        self.lazy_restore_all_in = Histogram(
            "ckptd_lazy_restore_all_in_seconds",
            "Lazy restores: from when the job ran to when every page was served (not observed "
            "when the job exited first).",
            registry=r, buckets=SECONDS_BUCKETS,
        )
        self.bytes_logical = Counter(
            "ckptd_checkpoint_bytes_logical",
            "Logical (before dedup and compression) bytes of committed checkpoints.", registry=r,
        )
        self.bytes_new = Counter(
            "ckptd_checkpoint_bytes_new",
            "Bytes committed checkpoints added to the store.", registry=r,
        )
        self.bytes_stored = Counter(
            "ckptd_checkpoint_bytes_stored",
            "Stored bytes of committed checkpoints (their 'bytes' figure).", registry=r,
        )
        self.dedup_ratio = Gauge(
            "ckptd_checkpoint_dedup_ratio",
            "Logical / stored bytes of the last committed checkpoint.", registry=r,
        )
        self.gpu_lock = Histogram(
            "ckptd_gpu_lock_seconds", "Time to lock CUDA processes for a checkpoint.",
            registry=r, buckets=SECONDS_BUCKETS,
        )
        self.gpu_checkpoint = Histogram(
            "ckptd_gpu_checkpoint_seconds", "Time to checkpoint CUDA state to host memory.",
            registry=r, buckets=SECONDS_BUCKETS,
        )
        self.migration_bytes_sent = Counter(
            "ckptd_migration_bytes_sent", "Bytes sent by successful migrations.", registry=r
        )
        self.migration_pages_sent = Counter(
            "ckptd_migration_pages_sent", "Pages sent by successful migrations.", registry=r
        )
        self.migration_downtime = Histogram(
            "ckptd_migration_downtime_seconds", "Downtime of successful migrations.",
            registry=r, buckets=SECONDS_BUCKETS,
        )
        self.policy_fired = Counter(
            "ckptd_policy_fired", "Checkpoint policies that fired.", registry=r
        )
        self.spot_notices = Counter(
            "ckptd_spot_notices", "Spot/preemption notices received.", registry=r
        )
        self.gc_bytes_freed = Counter(
            "ckptd_gc_bytes_freed", "Bytes freed by garbage collection.", registry=r
        )
        self.failures = Counter(
            "ckptd_failures",
            "Checkpoints, restores and migrations that failed, by operation and reason (the "
            "error's class, e.g. JobGone, CriuFailed).", ["operation", "reason"], registry=r,
        )
        self.last_checkpoint = Gauge(
            "ckptd_job_last_checkpoint_timestamp_seconds",
            "When the newest committed checkpoint of each named job was taken (Unix time); "
            f"the {MAX_JOB_NAMES} names checkpointed most recently.", ["name"], registry=r,
        )
        self._job_names: OrderedDict[str, None] = OrderedDict()
        self._job_names_lock = threading.Lock()
        # every known label value is exported from the start (as 0), so rate() works at once
        for kind in EventKind:
            self.events.labels(kind=kind.value)
        for outcome in ("committed", "failed"):
            self.checkpoints.labels(outcome=outcome)
        for outcome in ("done", "failed"):
            self.restores.labels(outcome=outcome)
            self.migrations.labels(outcome=outcome)
        self.restores.labels(outcome="lazy_failed")  # (a lazy restore done, then killed)
        if store_size is not None:
            r.register(_StoreCollector(store_size))

    # ---- feeding ----------------------------------------------------------------------------

    def on_event(self, event: Event) -> None:
        """Account for one event. Never raises (see the module's invariants)."""
        try:
            self._account(event)
        except Exception:
            log.warning("metrics: could not account for event %r", event, exc_info=True)

    def _account(self, event: Event) -> None:
        kind = event.kind
        self.events.labels(kind=str(getattr(kind, "value", kind))).inc()
        fields = event.fields if isinstance(event.fields, Mapping) else {}
        if kind == EventKind.CHECKPOINT_COMMITTED:
            self.checkpoints.labels(outcome="committed").inc()
            self._observe(self.checkpoint_duration, fields, "duration_s")
            self._observe(self.checkpoint_frozen, fields, "frozen_s")
            self._observe(self.gpu_lock, fields, "gpu_lock_s")
            self._observe(self.gpu_checkpoint, fields, "gpu_checkpoint_s")
            self._add(self.bytes_logical, fields, "bytes_logical")
            self._add(self.bytes_new, fields, "bytes_new")
            self._add(self.bytes_stored, fields, "bytes")
            if (ratio := _number(fields, "dedup_ratio")) is not None:
                self.dedup_ratio.set(ratio)
            if isinstance(event.name, str) and event.name:
                self._checkpointed(event.name, event.time)
        elif kind == EventKind.CHECKPOINT_FAILED:
            self.checkpoints.labels(outcome="failed").inc()
        elif kind == EventKind.RESTORE_DONE:
            self.restores.labels(outcome="done").inc()
            self._observe(self.restore_duration, fields, "duration_s")
        elif kind == EventKind.RESTORE_FAILED:
            self.restores.labels(outcome="failed").inc()
        elif kind == EventKind.RESTORE_LAZY_DONE and not fields.get("tree_ended"):
            self._observe(self.lazy_restore_all_in, fields, "seconds")
        elif kind == EventKind.RESTORE_LAZY_FAILED:
            self.restores.labels(outcome="lazy_failed").inc()
        elif kind == EventKind.MIGRATE_DONE:
            self.migrations.labels(outcome="done").inc()
            self._add(self.migration_bytes_sent, fields, "bytes_sent")
            self._add(self.migration_pages_sent, fields, "pages_sent")
            self._observe(self.migration_downtime, fields, "downtime_s")
        elif kind == EventKind.MIGRATE_FAILED:
            self.migrations.labels(outcome="failed").inc()
        elif kind == EventKind.POLICY_FIRED:
            self.policy_fired.inc()
        elif kind == EventKind.SPOT_NOTICE:
            self.spot_notices.inc()
        elif kind == EventKind.GC_DONE:
            self._add(self.gc_bytes_freed, fields, "bytes_freed")

        if kind in FAILED_OPERATION:
            self.failures.labels(operation=FAILED_OPERATION[kind],
                                 reason=failure_reason(fields)).inc()

    def _checkpointed(self, name: str, when: float) -> None:
        if isinstance(when, bool) or not isinstance(when, int | float) or \
                not math.isfinite(when):
            return
        with self._job_names_lock:
            self._job_names[name] = None
            self._job_names.move_to_end(name)
            self.last_checkpoint.labels(name=name).set(float(when))
            while len(self._job_names) > MAX_JOB_NAMES:
                oldest, _ = self._job_names.popitem(last=False)
                self.last_checkpoint.remove(oldest)

    @staticmethod
    def _observe(histogram: Histogram, fields: Mapping[str, Any], key: str) -> None:
        if (value := _number(fields, key)) is not None:
            histogram.observe(value)

    @staticmethod
    def _add(counter: Counter, fields: Mapping[str, Any], key: str) -> None:
        if (value := _number(fields, key)) is not None:
            counter.inc(value)

    # ---- exposing ---------------------------------------------------------------------------

    def render(self) -> bytes:
        """The Prometheus text exposition (version 0.0.4) of every metric, as of now."""
        return generate_latest(self.registry)

    def serve(self, listen: str) -> MetricsServer:
        """Serve the exposition over HTTP on ``listen`` (``"host:port"``, port 0: any free
        port, see ``MetricsServer.port``) from a daemon thread. Raises ValueError on a bad
        address, OSError when it can't be bound."""
        host, port = parse_listen(listen)
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        thread.name = "metrics-http"
        return MetricsServer(server, thread)
