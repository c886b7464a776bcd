"""Where a page goes: the structured log, a JSONL file, an HTTP webhook.

Two activities, because the sinks fail differently. `page` writes the log line and the JSONL record:
local, fast, and what the daily digest and an audit read. `deliver_webhook` makes one POST and raises
when it fails, so Temporal's retry policy owns the retrying; the workflow starts it without awaiting
it, so a webhook that is down delays no restart.
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import structlog
from temporalio import activity
from temporalio.exceptions import ApplicationError

from stayalive.core.decisions.paging import Page

log = structlog.get_logger()

WEBHOOK_TIMEOUT_S = 2.0  # one attempt; the retry policy spaces the next ones
# A client error will not heal on retry (a bad URL, a rejected body), except these two.
RETRYABLE_CLIENT_ERRORS = frozenset({408, 429})


@activity.defn
async def page(page: Page) -> None:
    """Log the page and append it to the JSONL file, if one is configured. Never touches the network."""
    log.warning(
        "page",
        run_id=page.run_id,
        summary=page.summary,
        rule=page.rule,
        evidence=page.evidence,
        action=page.action,
        **{"class": page.paging.value},
    )
    if page.jsonl_path:
        await asyncio.to_thread(append_jsonl, Path(page.jsonl_path), page.record())


@activity.defn
async def deliver_webhook(page: Page) -> None:
    """One POST of the page as JSON. Raises on failure (retryable unless the receiver refused the
    request itself), so Temporal retries with its backoff."""
    if not page.webhook_url:
        return
    await asyncio.to_thread(post_json, page.webhook_url, page.record(), WEBHOOK_TIMEOUT_S)


def append_jsonl(path: Path, record: dict[str, object]) -> None:
    """Append one line and fsync it: a page that was acknowledged survives a crash of the host.
    O_APPEND writes of one short line do not interleave with another writer's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def post_json(url: str, body: dict[str, object], timeout_s: float) -> None:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "User-Agent": "stayalive-pager"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        retryable = exc.code >= 500 or exc.code in RETRYABLE_CLIENT_ERRORS
        raise ApplicationError(
            f"webhook {url} answered {exc.code} {exc.reason}", type="WebhookRefused", non_retryable=not retryable
        ) from exc
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise ApplicationError(f"webhook {url} unreachable: {exc}", type="WebhookUnreachable") from exc
