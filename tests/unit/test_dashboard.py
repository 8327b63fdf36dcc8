"""deploy/grafana/ckptd-dashboard.json (issue 26, point 4): a valid Grafana dashboard whose
every query names metrics ckptd really exports, with the labels they really have.

- **Valid dashboard**: decoded with the dashboard model of grafana-foundation-sdk (PyPI;
  Grafana's types generated from its own schema) and encoded again, nothing may be lost or
  changed: a field the schema does not know (a typo, a field of another version) is dropped by
  the decoder and fails here. Beyond that model, the structure Grafana needs to draw a panel:
  unique ids, a grid position inside 24 columns, targets with unique refIds on the
  ``${datasource}`` variable.
- **Real metrics**: every PromQL expression (Grafana's ``$__rate_interval``, ``$__range`` and
  ``$instance`` substituted) is parsed by promql-parser (PyPI, the Rust parser Prometheus-
  compatible databases use) and each selector checked against the exposition of a real
  ``Metrics`` fed one event of every kind: its name is a series ckptd exports, each label it
  matches or aggregates by is one that series has (or ``instance``/``job``, which Prometheus
  adds to every scraped series), and an equality on ``outcome``, ``kind`` or ``operation``
  names a value ckptd exports.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ckptd.daemon.metrics import Metrics
from ckptd.domain import Event, EventKind

promql = pytest.importorskip("promql_parser", reason="pip install promql-parser (dev extra)")
grafana = pytest.importorskip("grafana_foundation_sdk.models.dashboard",
                              reason="pip install grafana-foundation-sdk (dev extra)")
cog_encoder = pytest.importorskip("grafana_foundation_sdk.cog.encoder")

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "ckptd-dashboard.json"
TARGET_LABELS = {"instance", "job"}
"""Labels Prometheus adds to every series it scrapes."""
ENUMERATED = {"outcome", "kind", "operation"}
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__range": "6h", "$__interval": "1m",
                     "$instance": ".*"}


def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def exported() -> dict[str, dict[str, set[str]]]:
    """Series name -> label name -> values seen, from a real ``Metrics`` fed every kind."""
    m = Metrics(store_size=lambda: (3, 4096))
    fields = {"bytes": 10, "bytes_logical": 40, "bytes_new": 5, "frozen_s": 0.1,
              "duration_s": 0.5, "dedup_ratio": 4.0, "gpu_lock_s": 0.1,
              "gpu_checkpoint_s": 0.2, "bytes_sent": 1, "pages_sent": 1, "downtime_s": 0.1,
              "bytes_freed": 1, "error": "CriuFailed"}
    for i, kind in enumerate(EventKind):
        m.on_event(Event(seq=i, time=1000.0 + i, kind=kind, pid=1, name="train-7",
                         fields=fields))
    series: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for family in text_string_to_metric_families(m.render().decode()):
        for sample in family.samples:
            labels = series[sample.name]
            for key, val in sample.labels.items():
                labels[key].add(val)
    return series


def expressions(data: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and query variable."""
    for panel in data["panels"]:
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} target {target['refId']}", target["expr"]
    for var in data["templating"]["list"]:
        if var["type"] == "query":
            match = re.fullmatch(r"label_values\((\w+), *(\w+)\)", var["query"]["query"])
            assert match, f"variable {var['name']}: only label_values(METRIC, LABEL) is used"
            yield f"variable {var['name']}", f"count by ({match[2]}) ({match[1]})"


def selectors(node: Any, by: set[str]) -> Iterator[tuple[Any, set[str]]]:
    """Each vector selector of the AST, with the labels of every ``by`` above it."""
    if isinstance(node, promql.VectorSelector):
        yield node, by
    elif isinstance(node, promql.MatrixSelector):
        yield from selectors(node.vector_selector, by)
    elif isinstance(node, promql.AggregateExpr):
        inner = by | set(node.modifier.labels) if node.modifier is not None else by
        yield from selectors(node.expr, inner)
    elif isinstance(node, promql.BinaryExpr):
        yield from selectors(node.lhs, by)
        yield from selectors(node.rhs, by)
    elif isinstance(node, promql.Call):
        for arg in node.args:
            yield from selectors(arg, by)
    elif isinstance(node, promql.ParenExpr | promql.UnaryExpr | promql.SubqueryExpr):
        yield from selectors(node.expr, by)


def test_the_dashboard_survives_grafanas_dashboard_model_unchanged() -> None:
    data = dashboard()
    model = grafana.Dashboard.from_json(data)
    again = json.loads(cog_encoder.JSONEncoder().encode(model))

    def leaves(x: Any, path: str = "") -> Iterator[tuple[str, Any]]:
        if isinstance(x, dict):
            for k, v in x.items():
                yield from leaves(v, f"{path}/{k}")
        elif isinstance(x, list) and x:
            for i, v in enumerate(x):
                yield from leaves(v, f"{path}/{i}")
        else:
            yield path, x

    got = dict(leaves(again))
    for path, value in leaves(data):
        assert path in got, f"{path}: not in Grafana's dashboard model (dropped by its decoder)"
        assert got[path] == value, f"{path}: {value!r} came back as {got[path]!r}"


def test_the_dashboard_is_drawable() -> None:
    data = dashboard()
    assert data["uid"] and data["title"] and isinstance(data["schemaVersion"], int)
    names = [v["name"] for v in data["templating"]["list"]]
    assert names[:1] == ["datasource"], "the Prometheus data source is a variable"
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {ids}"
    for panel in data["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), f"{panel['title']}: refIds {refs}"
        assert all(t["datasource"] == panel["datasource"] for t in panel["targets"])


def test_every_query_names_an_exported_metric_with_its_real_labels() -> None:
    series = exported()
    checked = 0
    for where, query in expressions(dashboard()):
        expr = query
        for var, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(var, value)
        try:
            ast = promql.parse(expr)
        except Exception as exc:  # the parser raises its own (Rust) exception type
            raise AssertionError(f"{where}: {expr!r} is not PromQL: {exc}") from exc
        found = list(selectors(ast, set()))
        assert found, f"{where}: {expr!r} selects no metric"
        for selector, by in found:
            name = selector.name
            assert name in series, f"{where}: ckptd exports no {name!r}"
            labels = series[name]
            matchers = selector.matchers.matchers
            for label in {m.name for m in matchers} | by:
                assert label in labels or label in TARGET_LABELS, (
                    f"{where}: {name} has no label {label!r} (it has "
                    f"{sorted(labels) or 'none'}, and Prometheus adds {sorted(TARGET_LABELS)})")
            for m in matchers:
                if m.name in ENUMERATED and str(m.op) == "MatchOp.Equal":
                    assert m.value in labels[m.name], (
                        f"{where}: {name}{{{m.name}={m.value!r}}}: ckptd exports "
                        f"{sorted(labels[m.name])}")
            checked += 1
    assert checked >= 15, f"only {checked} selectors checked"


def test_the_checks_catch_a_wrong_metric_and_a_wrong_label(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """The test above fails on a misspelt metric, an unknown label, an outcome value ckptd
    never exports, and an aggregation by a label the series lacks."""
    for bad in ('rate(ckptd_checkpoint_total[5m])',
                'rate(ckptd_checkpoints_total{node="a"}[5m])',
                'rate(ckptd_checkpoints_total{outcome="ok"}[5m])',
                'sum by (reason) (ckptd_restores_total)'):
        data = dashboard()
        data["panels"][0]["targets"][0]["expr"] = bad
        path = tmp_path / "d.json"
        path.write_text(json.dumps(data))
        monkeypatch.setitem(globals(), "DASHBOARD", path)
        with pytest.raises(AssertionError):
            test_every_query_names_an_exported_metric_with_its_real_labels()
