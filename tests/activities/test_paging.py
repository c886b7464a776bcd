"""The sinks of a page: the log line, the JSONL file, the webhook (a real HTTP server on 127.0.0.1)."""

from __future__ import annotations

import json
import socket
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from structlog.testing import capture_logs
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from stayalive.activities.paging import deliver_webhook, page
from stayalive.core.decisions.paging import Page
from stayalive.core.run.timeline import Classification, PagingClass
from tests.helpers import Webhook

SAME_NODE = Classification(
    paging=PagingClass.CORRELATED,
    rule="same node twice",
    evidence="node n3 failed again after it was quarantined",
    action="quarantine is not holding n3 out: check the fleet's quarantine records",
)
AT = datetime(2026, 1, 1, 3, 0, tzinfo=UTC)


def a_page(**where: str) -> Page:
    return Page.of("run-a/1234abcd", AT, SAME_NODE, "crash on node n3 rank 5 at step 1810", **where)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


async def test_a_page_reaches_the_webhook_as_json(webhook: Webhook) -> None:
    await ActivityEnvironment().run(deliver_webhook, a_page(webhook_url=webhook.url))
    [(headers, body)] = webhook.received
    assert headers["Content-Type"] == "application/json"
    assert json.loads(body) == {
        "run_id": "run-a/1234abcd",
        "at": "2026-01-01T03:00:00Z",
        "paging": "correlated",
        "rule": "same node twice",
        "summary": "crash on node n3 rank 5 at step 1810",
        "evidence": "node n3 failed again after it was quarantined",
        "action": "quarantine is not holding n3 out: check the fleet's quarantine records",
    }


async def test_a_down_webhook_fails_fast_and_retryably() -> None:
    started = time.monotonic()
    with pytest.raises(ApplicationError, match="unreachable") as raised:
        await ActivityEnvironment().run(deliver_webhook, a_page(webhook_url=f"http://127.0.0.1:{closed_port()}/"))
    assert time.monotonic() - started < 2.0
    assert not raised.value.non_retryable


async def test_a_webhook_that_accepts_and_never_answers_times_out_in_seconds() -> None:
    with socket.socket() as silent:  # the kernel completes the handshake; nobody ever reads or replies
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/"
        started = time.monotonic()
        with pytest.raises(ApplicationError, match="unreachable"):
            await ActivityEnvironment().run(deliver_webhook, a_page(webhook_url=url))
    assert time.monotonic() - started < 3.0


@pytest.mark.parametrize(("status", "retryable"), [(500, True), (503, True), (429, True), (400, False), (404, False)])
async def test_a_refusing_webhook_is_retried_only_when_retrying_can_help(
    webhook: Webhook, status: int, retryable: bool
) -> None:
    webhook.status = status
    with pytest.raises(ApplicationError, match=f"answered {status}") as raised:
        await ActivityEnvironment().run(deliver_webhook, a_page(webhook_url=webhook.url))
    assert raised.value.non_retryable is not retryable


async def test_no_webhook_configured_is_nothing_to_deliver() -> None:
    await ActivityEnvironment().run(deliver_webhook, a_page())


async def test_page_logs_and_appends_one_parseable_line_per_page(tmp_path: Path) -> None:
    journal = tmp_path / "pages" / "pages.jsonl"
    with capture_logs() as logs:
        for _ in range(3):
            await ActivityEnvironment().run(page, a_page(jsonl_path=str(journal), webhook_url="http://unused"))
    lines = journal.read_text().splitlines()
    assert len(lines) == 3
    assert all(json.loads(line) == a_page().record() for line in lines)
    assert "webhook_url" not in lines[0]  # where a page goes is not part of it
    [entry, *_] = logs
    assert entry["event"] == "page" and entry["log_level"] == "warning"
    expected = {"run_id": "run-a/1234abcd", "class": "correlated", "rule": "same node twice"}
    assert expected.items() <= entry.items()
    assert entry["action"] == SAME_NODE.action and entry["evidence"] == SAME_NODE.evidence


async def test_page_without_a_journal_only_logs(tmp_path: Path) -> None:
    with capture_logs() as logs:
        await ActivityEnvironment().run(page, a_page())
    assert [entry["event"] for entry in logs] == ["page"]
    assert list(tmp_path.iterdir()) == []
