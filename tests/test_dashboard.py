"""The dashboard check's PromQL reading (tests/dashboard.py), on expressions whose names are known.
The check against a real scrape is in tests/e2e/test_goodput.py."""

from __future__ import annotations

import pytest

from stayalive.activities.metrics import Exporter
from tests.dashboard import dashboard_uses, exposition, label_names, load_dashboard, metric_names

CASES = [
    # expression, metrics, labels
    ("up", {"up"}, set()),
    ('stayalive_goodput_ratio{run_id=~"$run_id"}', {"stayalive_goodput_ratio"}, {"run_id"}),
    (
        'max by (run_id) (sum without (category) (stayalive_ledger_seconds{run_id=~"$run_id", category!="idle"}))',
        {"stayalive_ledger_seconds"},
        {"run_id", "category"},
    ),
    (
        'round(sum by (cause) (increase(stayalive_interruptions{run_id=~"${run_id:regex}"}[$__range]))) > 0',
        {"stayalive_interruptions"},
        {"cause", "run_id"},
    ),
    (
        "a_total / ignoring(category) group_left b:recorded + on (x, y) group_right (z) c * 1e3 offset 5m",
        {"a_total", "b:recorded", "c"},
        {"category", "x", "y", "z"},
    ),
    ("rate(m[$__rate_interval]) and m2 unless bool_metric or vector(1)", {"m", "m2", "bool_metric"}, set()),
    ('max_over_time(m{a="by (b)", c=~".+"}[1h:5m]) / scalar(max(n))', {"m", "n"}, {"a", "c"}),
    ("sum(m) / $__range_s * 100", {"m"}, set()),
]


@pytest.mark.parametrize(("expr", "metrics", "labels"), CASES)
def test_it_reads_the_metrics_and_labels_of_an_expression(expr: str, metrics: set[str], labels: set[str]) -> None:
    assert metric_names(expr) == metrics
    assert label_names(expr) == labels


def test_a_metric_named_through_name_is_refused() -> None:
    with pytest.raises(ValueError, match="__name__"):
        metric_names('{__name__="stayalive_goodput_ratio"}')


def test_template_variables_and_legends_count() -> None:
    board = {
        "panels": [
            {
                "type": "row",
                "panels": [{"title": "t", "targets": [{"refId": "A", "expr": "m", "legendFormat": "{{x}}"}]}],
            }
        ],
        "templating": {
            "list": [
                {"name": "v", "type": "query", "query": {"query": 'label_values(n{a="1"}, run_id)'}},
                {"name": "w", "type": "query", "query": "label_values(job)"},
                {"name": "i", "type": "interval", "query": "1m,5m"},
            ]
        },
    }
    uses = {use.where: (set(use.metrics), set(use.labels)) for use in dashboard_uses(board)}
    assert uses == {
        "panel 't' target A": ({"m"}, {"x"}),
        "variable 'v'": ({"n"}, {"a", "run_id"}),
        "variable 'w'": (set(), {"job"}),
    }
    with pytest.raises(ValueError, match="cannot read"):
        dashboard_uses({"templating": {"list": [{"name": "q", "type": "query", "query": "metrics(stayalive_.*)"}]}})


def test_an_exposition_gives_its_names_and_labels() -> None:
    text = (
        '# HELP a_total A.\n# TYPE a_total counter\na_total{x="1"} 2.0\n'
        '# HELP g G.\n# TYPE g gauge\ng{run_id="r",cause="crash"} 1.0\ng{run_id="s",cause="hang"} 0.0\n'
        "# HELP empty Declared, no samples yet.\n# TYPE empty gauge\n"
    )
    scrape = exposition(text)
    assert scrape.names == {"a", "a_total", "g", "empty"}
    assert scrape.labels == {"a_total": {"x"}, "g": {"run_id", "cause"}}


def test_the_dashboard_reads_only_what_the_exporter_declares() -> None:
    """The quick check, on the exporter's declarations; the e2e test checks a real scrape."""
    declared = {family.name for family in Exporter().registry.collect()}
    read = {name for use in dashboard_uses(load_dashboard()) for name in use.metrics}
    assert read and read <= declared, read - declared
