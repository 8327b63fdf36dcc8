"""Metrics: events in, Prometheus exposition out (own registry, never raising, HTTP endpoint)."""

from __future__ import annotations

import math
import urllib.request
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from ckptd.core.events import EventBus
from ckptd.daemon.metrics import Metrics, parse_listen
from ckptd.domain import Event, EventKind
from ckptd.testing import FakeClock


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition: (name, sorted labels) -> value."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics: Metrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, tuple(sorted(labels.items())))]


def event(kind: EventKind, **fields: Any) -> Event:
    return Event(seq=1, time=0.0, kind=kind, pid=42, fields=fields)


COMMITTED: dict[str, Any] = {
    "bytes": 1000, "bytes_logical": 4000, "bytes_new": 300, "frozen_s": 0.2,
    "duration_s": 1.5, "dedup_ratio": 4.0,
}


def test_starts_at_zero_with_every_label_known() -> None:
    m = Metrics()
    s = samples(m)
    for kind in EventKind:
        assert s[("ckptd_events_total", (("kind", kind.value),))] == 0
    assert s[("ckptd_checkpoints_total", (("outcome", "committed"),))] == 0
    assert s[("ckptd_checkpoints_total", (("outcome", "failed"),))] == 0
    assert s[("ckptd_restores_total", (("outcome", "done"),))] == 0
    assert s[("ckptd_migrations_total", (("outcome", "failed"),))] == 0
    assert s[("ckptd_checkpoint_duration_seconds_count", ())] == 0
    assert not any(name.startswith("ckptd_store_") for name, _ in s)


def test_committed_checkpoints_through_a_real_bus() -> None:
    clock = FakeClock()
    bus = EventBus(clock)
    m = Metrics()
    bus.add_listener(m.on_event)
    bus.publish(EventKind.CHECKPOINT_STARTED, pid=1)
    bus.publish(EventKind.CHECKPOINT_COMMITTED, pid=1, checkpoint_id="c1", **COMMITTED)
    bus.publish(EventKind.CHECKPOINT_COMMITTED, pid=1, checkpoint_id="c2",
                **{**COMMITTED, "duration_s": 700.0, "dedup_ratio": 2.0,
                   "gpu_lock_s": 0.05, "gpu_checkpoint_s": 3.0})
    bus.publish(EventKind.CHECKPOINT_FAILED, pid=1, error="CriuFailed")

    assert value(m, "ckptd_checkpoints_total", outcome="committed") == 2
    assert value(m, "ckptd_checkpoints_total", outcome="failed") == 1
    assert value(m, "ckptd_events_total", kind="checkpoint.started") == 1
    assert value(m, "ckptd_events_total", kind="checkpoint.committed") == 2
    assert value(m, "ckptd_events_total", kind="checkpoint.failed") == 1
    assert value(m, "ckptd_checkpoint_duration_seconds_count") == 2
    assert value(m, "ckptd_checkpoint_duration_seconds_sum") == pytest.approx(701.5)
    assert value(m, "ckptd_checkpoint_duration_seconds_bucket", le="2.5") == 1
    assert value(m, "ckptd_checkpoint_duration_seconds_bucket", le="1200.0") == 2
    assert value(m, "ckptd_checkpoint_duration_seconds_bucket", le="+Inf") == 2
    assert value(m, "ckptd_checkpoint_frozen_seconds_sum") == pytest.approx(0.4)
    assert value(m, "ckptd_checkpoint_bytes_logical_total") == 8000
    assert value(m, "ckptd_checkpoint_bytes_new_total") == 600
    assert value(m, "ckptd_checkpoint_bytes_stored_total") == 2000
    assert value(m, "ckptd_checkpoint_dedup_ratio") == 2.0  # the last one
    assert value(m, "ckptd_gpu_lock_seconds_count") == 1
    assert value(m, "ckptd_gpu_lock_seconds_bucket", le="0.01") == 0
    assert value(m, "ckptd_gpu_lock_seconds_bucket", le="0.05") == 1
    assert value(m, "ckptd_gpu_checkpoint_seconds_sum") == pytest.approx(3.0)


def test_buckets_span_10ms_to_30min() -> None:
    m = Metrics()
    les = {
        dict(labels)["le"]
        for (name, labels) in samples(m)
        if name == "ckptd_restore_duration_seconds_bucket"
    }
    bounds = sorted(float(le) for le in les)
    assert bounds[0] == 0.01
    assert 1800.0 in bounds
    assert bounds[-1] == math.inf


def test_restores_migrations_policy_spot_gc() -> None:
    m = Metrics()
    m.on_event(event(EventKind.RESTORE_DONE, duration_s=2.0))
    m.on_event(event(EventKind.RESTORE_FAILED, error="RestoreFailed"))
    m.on_event(event(EventKind.MIGRATE_DONE, bytes_sent=5000, pages_sent=3, downtime_s=0.3))
    m.on_event(event(EventKind.MIGRATE_DONE, bytes_sent=1000, pages_sent=1, downtime_s=0.1))
    m.on_event(event(EventKind.MIGRATE_FAILED, error="PeerUnreachable"))
    m.on_event(event(EventKind.POLICY_FIRED))
    m.on_event(event(EventKind.SPOT_NOTICE))
    m.on_event(event(EventKind.SPOT_NOTICE))
    m.on_event(event(EventKind.GC_DONE, bytes_freed=123, checkpoints_deleted=1))
    m.on_event(event(EventKind.DRAIN))
    m.on_event(event(EventKind.RESUME))

    assert value(m, "ckptd_restores_total", outcome="done") == 1
    assert value(m, "ckptd_restores_total", outcome="failed") == 1
    assert value(m, "ckptd_restore_duration_seconds_sum") == 2.0
    assert value(m, "ckptd_migrations_total", outcome="done") == 2
    assert value(m, "ckptd_migrations_total", outcome="failed") == 1
    assert value(m, "ckptd_migration_bytes_sent_total") == 6000
    assert value(m, "ckptd_migration_pages_sent_total") == 4
    assert value(m, "ckptd_migration_downtime_seconds_count") == 2
    assert value(m, "ckptd_migration_downtime_seconds_sum") == pytest.approx(0.4)
    assert value(m, "ckptd_policy_fired_total") == 1
    assert value(m, "ckptd_spot_notices_total") == 2
    assert value(m, "ckptd_gc_bytes_freed_total") == 123
    assert value(m, "ckptd_events_total", kind="drain") == 1
    assert value(m, "ckptd_events_total", kind="resume") == 1
    assert value(m, "ckptd_events_total", kind="gc.done") == 1


@pytest.mark.parametrize(
    "weird",
    ["12", None, True, float("nan"), float("inf"), -5, [1], {"a": 1}, object()],
)
def test_weird_fields_are_ignored_not_raised(weird: object) -> None:
    m = Metrics()
    fields: dict[str, Any] = dict.fromkeys(
        (*COMMITTED, "gpu_lock_s", "gpu_checkpoint_s", "bytes_sent", "pages_sent",
         "downtime_s", "bytes_freed"),
        weird,
    )
    for kind in (EventKind.CHECKPOINT_COMMITTED, EventKind.RESTORE_DONE,
                 EventKind.MIGRATE_DONE, EventKind.GC_DONE):
        m.on_event(event(kind, **fields))
    # the events still count; the figures are left alone
    assert value(m, "ckptd_checkpoints_total", outcome="committed") == 1
    assert value(m, "ckptd_migrations_total", outcome="done") == 1
    assert value(m, "ckptd_events_total", kind="gc.done") == 1
    assert value(m, "ckptd_checkpoint_duration_seconds_count") == 0
    assert value(m, "ckptd_checkpoint_bytes_logical_total") == 0
    assert value(m, "ckptd_checkpoint_dedup_ratio") == 0
    assert value(m, "ckptd_migration_bytes_sent_total") == 0
    assert value(m, "ckptd_gc_bytes_freed_total") == 0


def test_malformed_events_do_not_raise() -> None:
    m = Metrics()
    m.on_event(Event(seq=1, time=0.0, kind=EventKind.CHECKPOINT_COMMITTED,
                     fields=None))  # type: ignore[arg-type]
    m.on_event(Event(seq=2, time=0.0, kind="future.kind"))  # type: ignore[arg-type]
    m.on_event(None)  # type: ignore[arg-type]
    assert value(m, "ckptd_checkpoints_total", outcome="committed") == 1
    assert value(m, "ckptd_events_total", kind="future.kind") == 1


def test_partial_fields_count_what_is_there() -> None:
    m = Metrics()
    m.on_event(event(EventKind.CHECKPOINT_COMMITTED, duration_s=1, bytes_new="lots"))
    assert value(m, "ckptd_checkpoint_duration_seconds_count") == 1
    assert value(m, "ckptd_checkpoint_bytes_new_total") == 0


def test_store_size_is_asked_at_scrape_time() -> None:
    calls: list[int] = []
    size = [(0, 0)]

    def store_size() -> tuple[int, int]:
        calls.append(1)
        return size[0]

    m = Metrics(store_size)
    assert calls == []  # not at construction
    m.on_event(event(EventKind.CHECKPOINT_COMMITTED, **COMMITTED))
    assert calls == []  # nor on events
    size[0] = (3, 4096)
    assert value(m, "ckptd_store_checkpoints") == 3
    assert value(m, "ckptd_store_bytes") == 4096
    size[0] = (4, 5000)
    assert value(m, "ckptd_store_checkpoints") == 4
    assert value(m, "ckptd_store_bytes") == 5000


def test_failing_store_size_leaves_the_rest_served() -> None:
    def store_size() -> tuple[int, int]:
        raise OSError("store unreachable")

    m = Metrics(store_size)
    m.on_event(event(EventKind.POLICY_FIRED))
    s = samples(m)
    assert s[("ckptd_policy_fired_total", ())] == 1
    assert not any(name.startswith("ckptd_store_") for name, _ in s)


def test_own_registry_instances_are_independent() -> None:
    a, b = Metrics(), Metrics(lambda: (1, 2))  # no duplicate-registration error
    a.on_event(event(EventKind.SPOT_NOTICE))
    assert value(a, "ckptd_spot_notices_total") == 1
    assert value(b, "ckptd_spot_notices_total") == 0
    assert REGISTRY.get_sample_value("ckptd_spot_notices_total") is None


def test_parse_listen() -> None:
    assert parse_listen("127.0.0.1:9100") == ("127.0.0.1", 9100)
    assert parse_listen(":9100") == ("0.0.0.0", 9100)
    assert parse_listen("[::1]:0") == ("::1", 0)
    assert parse_listen("localhost:0") == ("localhost", 0)
    for bad in ("9100", "host:", "host:x", "host:70000", "::1:9100", ""):
        with pytest.raises(ValueError):
            parse_listen(bad)


def test_serve_http_then_stop() -> None:
    m = Metrics(lambda: (2, 10))
    m.on_event(event(EventKind.RESTORE_DONE, duration_s=0.5))
    server = m.serve("127.0.0.1:0")
    try:
        assert server.port > 0
        url = f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
            text = resp.read().decode()
    finally:
        server.stop()
    server.stop()  # idempotent
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert got[("ckptd_restores_total", (("outcome", "done"),))] == 1
    assert got[("ckptd_store_checkpoints", ())] == 2
    assert got[("ckptd_store_bytes", ())] == 10
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)


def test_serve_rejects_a_bad_address() -> None:
    with pytest.raises(ValueError):
        Metrics().serve("nonsense")


def test_failures_by_operation_and_reason_bounded() -> None:
    m = Metrics()
    m.on_event(event(EventKind.CHECKPOINT_FAILED, error="CriuFailed"))
    m.on_event(event(EventKind.CHECKPOINT_FAILED, error="CriuFailed"))
    m.on_event(event(EventKind.RESTORE_FAILED, error="JobGone"))
    m.on_event(event(EventKind.MIGRATE_FAILED))
    m.on_event(event(EventKind.RESTORE_FAILED, error="not an identifier: /etc/x"))
    m.on_event(event(EventKind.RESTORE_FAILED, error="E" * 65))
    s = samples(m)
    failures = {labels: v for (name, labels), v in s.items() if name == "ckptd_failures_total"}
    assert failures == {
        (("operation", "checkpoint"), ("reason", "CriuFailed")): 2,
        (("operation", "restore"), ("reason", "JobGone")): 1,
        (("operation", "migration"), ("reason", "unknown")): 1,
        (("operation", "restore"), ("reason", "unknown")): 2,
    }
    assert value(m, "ckptd_checkpoints_total", outcome="failed") == 2


def test_last_checkpoint_time_per_job_name_keeps_the_most_recent_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ckptd.daemon.metrics as metrics_module

    monkeypatch.setattr(metrics_module, "MAX_JOB_NAMES", 2)
    m = Metrics()

    def committed(name: str, when: float) -> None:
        m.on_event(Event(seq=1, time=when, kind=EventKind.CHECKPOINT_COMMITTED, pid=1,
                         name=name, fields=COMMITTED))

    committed("a", 100.0)
    committed("", 150.0)                      # unnamed: no series
    committed("b", 200.0)
    committed("a", 300.0)                     # a is now the most recent
    committed("c", 400.0)                     # b, the oldest, goes
    series = {labels: v for (name, labels), v in samples(m).items()
              if name == "ckptd_job_last_checkpoint_timestamp_seconds"}
    assert series == {(("name", "a"),): 300.0, (("name", "c"),): 400.0}


def test_lazy_restores_all_in_time_and_failures() -> None:
    """A lazy restore is counted done when the job runs (restore.done); its end adds how long
    every page took (restore.lazy_done), or a failure of its own (restore.lazy_failed: the job
    was killed), with its reason."""
    m = Metrics()
    assert value(m, "ckptd_restores_total", outcome="lazy_failed") == 0
    m.on_event(event(EventKind.RESTORE_LAZY_DONE, pages=1000, seconds=2.5, tree_ended=False))
    # the tree exited before every page came in: no "all in" time to observe
    m.on_event(event(EventKind.RESTORE_LAZY_DONE, pages=12, seconds=0.05, tree_ended=True))
    m.on_event(event(EventKind.RESTORE_LAZY_FAILED, error="CorruptCheckpoint"))
    assert value(m, "ckptd_lazy_restore_all_in_seconds_sum") == 2.5
    assert value(m, "ckptd_lazy_restore_all_in_seconds_count") == 1
    assert value(m, "ckptd_restores_total", outcome="lazy_failed") == 1
    assert value(m, "ckptd_failures_total", operation="restore", reason="CorruptCheckpoint") == 1
