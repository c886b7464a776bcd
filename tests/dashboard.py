"""What the Grafana dashboard asks Prometheus for, and what a supervisor's /metrics offers.

`dashboard_uses` reads every PromQL expression of deploy/grafana/dashboards/stayalive.json (panel
targets, and template variables' `label_values(...)`) and names the metrics and labels each one
needs; `exposition` reads a scrape's text. The tests compare the two, so a metric renamed in
activities/metrics.py, or a typo in the dashboard, breaks a test instead of an empty panel.

The extraction is a lexer, not a PromQL parser: it drops what is not a name (strings, durations,
Grafana variables), takes the labels out of matchers and grouping clauses, and calls every other
identifier not followed by `(` a metric. That is exact for the expressions a dashboard writes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "stayalive.json"

# PromQL's reserved words; functions and aggregations are told apart by the `(` that follows them.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless"}
KEYWORDS |= {"atan2", "inf", "nan"}
STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")  # Grafana's: $run_id, ${run_id:regex}, $__range
RANGE = re.compile(r"\[[^\]]*\]")  # [5m], [$__rate_interval], [1h:5m]
MATCHERS = re.compile(r"\{([^}]*)\}")
MATCHER_LABEL = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
IDENTIFIER = re.compile(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?")
LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_]\w*)\s*\}\}")
LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.*),)?\s*([A-Za-z_]\w*)\s*\)\s*$", re.DOTALL)


@dataclass(frozen=True)
class Use:
    """One expression of the dashboard: where it is, the metrics it reads, the labels it needs on them."""

    where: str
    expr: str
    metrics: frozenset[str]
    labels: frozenset[str]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    if "__name__" in expr:
        raise ValueError(f"names a metric through __name__, which this check cannot follow: {expr}")
    text = MATCHERS.sub(" ", _lexable(expr))
    text = GROUPING.sub(" ", text)
    return {name for name, call in IDENTIFIER.findall(text) if not call and name.lower() not in KEYWORDS}


def label_names(expr: str) -> set[str]:
    """The labels a PromQL expression matches on, groups by or joins on."""
    text = _lexable(expr)
    labels = {label for block in MATCHERS.findall(text) for label in MATCHER_LABEL.findall(block)}
    labels |= {label.strip() for clause in GROUPING.findall(text) for label in clause.split(",") if label.strip()}
    return labels


def _lexable(expr: str) -> str:
    # Strings first: a matcher's value may hold anything, a Grafana variable included.
    text = STRING.sub('""', expr)
    text = RANGE.sub(" ", text)
    return VARIABLE.sub(" 0 ", text)


def dashboard_uses(dashboard: dict[str, Any]) -> list[Use]:
    """Every PromQL expression of a dashboard, with the metrics and labels it needs; a legend's
    `{{label}}` counts as a label the expression needs."""
    uses = []
    for panel in _panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            expr = target.get("expr", "")
            legend = set(LEGEND_LABEL.findall(target.get("legendFormat", "")))
            where = f"panel {panel.get('title')!r} target {target.get('refId')}"
            uses.append(Use(where, expr, frozenset(metric_names(expr)), frozenset(label_names(expr) | legend)))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        query = query.get("query", "") if isinstance(query, dict) else str(query)
        where = f"variable {variable.get('name')!r}"
        if match := LABEL_VALUES.match(query):
            expr, label = match.group(1) or "", match.group(2)
            uses.append(Use(where, query, frozenset(metric_names(expr)), frozenset(label_names(expr) | {label})))
        else:  # query_result(), metrics(): not used here; fail rather than let one go unchecked
            raise ValueError(f"{where}: cannot read the metrics of {query!r}")
    return uses


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # a collapsed row holds its panels


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(path.read_text())
    return dashboard


def datasource_uids(dashboard: dict[str, Any]) -> set[str]:
    """Every datasource uid the dashboard names, at any depth (panels, targets, variables)."""
    uids: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            source = node.get("datasource")
            if isinstance(source, dict) and "uid" in source:
                uids.add(str(source["uid"]))
            elif isinstance(source, str):  # the old form names a datasource by its name
                uids.add(source)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(dashboard)
    return uids


@dataclass(frozen=True)
class Exposition:
    """A scrape: every metric name it declares (`# TYPE` families and sample names), and the label
    names of the samples each one has (a family with no samples yet is in `names` only)."""

    names: frozenset[str]
    labels: dict[str, frozenset[str]]


def exposition(text: str) -> Exposition:
    names: set[str] = set()
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        for sample in family.samples:
            names.add(sample.name)
            labels.setdefault(sample.name, set()).update(sample.labels)
    return Exposition(frozenset(names), {name: frozenset(found) for name, found in labels.items()})
