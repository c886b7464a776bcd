"""What an operator sees of a run in the Temporal web UI, read in a real browser: headless Chromium
(Debian's `chromium`, which .ci/run installs) driven over the DevTools protocol (tests/browser.py).

Skipped, with the reason, where Chromium is missing; STAYALIVE_REQUIRE_BROWSER=1 (CI) makes that a
failure. STAYALIVE_SCREENSHOTS=DIR keeps the pages as PNGs (docs/web-ui-*.png came from there).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from urllib.parse import quote

import pytest
from temporalio.client import Client

from stayalive.core.run.lifecycle import RunState
from stayalive.core.run.timeline import Cause
from stayalive.workers.devstack import DevStack
from tests.browser import chromium, open_browser
from tests.helpers import activity_log, start, tiny_spec


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("STAYALIVE_SCREENSHOTS", tmp_path / "screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(autouse=True)
def browser_installed() -> None:
    if chromium() is None:
        if os.environ.get("STAYALIVE_REQUIRE_BROWSER"):
            pytest.fail("chromium is required here: apt-get install chromium")
        pytest.skip("chromium is not installed (apt-get install chromium); CI installs it")


async def test_the_web_ui_tells_the_crash_in_words_shows_the_health_table_and_filters_on_run_state(
    client: Client, stack: DevStack, checkpoint_root: Path, tmp_path: Path, screenshots: Path
) -> None:
    assert stack.ui_url is not None
    spec = tiny_spec(checkpoint_root, target_step=60, faults=[{"kind": "crash", "rank": 3, "at_step": 25}])
    handle = await start(client, spec, "web-ui")
    result = await handle.result()
    assert result.state == RunState.COMPLETED
    assert [(i.cause, i.node) for i in result.interruptions] == [(Cause.CRASH, "n2")]
    # What the run's activities said of the crash, as the workflow wrote their summaries.
    said = [summary for kind, _, summary in await activity_log(client, handle) if kind in ("local", "scheduled")]
    about_the_crash = [s for s in said if isinstance(s, str) and "crash on node n2 rank 3" in s]
    assert any(s.startswith("quarantine n2") for s in about_the_crash), said
    run_id = (await handle.describe()).run_id
    workflows = f"{stack.ui_url}/namespaces/default/workflows"

    async with open_browser(tmp_path / "chromium") as browser:
        # The history reads as a log: the crash's quarantine and page in words; nothing left pending.
        await browser.open(f"{workflows}/{quote(handle.id)}/{run_id}/history")
        await browser.wait_for(*about_the_crash, "Pending Activities\n0", "COMPLETED")
        await browser.scroll_to(next(s for s in about_the_crash if s.startswith("quarantine n2")))
        await browser.screenshot(screenshots / "web-ui-history.png")

        # The current details: the run's health table.
        await browser.click("User Metadata")
        await browser.wait_for("Current Details", "last valid checkpoint", "step 60", "measured at", "n1, n3")
        await browser.screenshot(screenshots / "web-ui-details.png")

        # The run list filters on the run's state (a search attribute the workflow keeps).
        completed, failed = (quote(f'WorkflowId = "{handle.id}" AND RunState = "{s}"') for s in ("COMPLETED", "FAILED"))
        await browser.open(f"{workflows}?query={completed}")
        await browser.wait_for(run_id)
        await browser.open(f"{workflows}?query={failed}")
        await browser.wait_for('RunState = "FAILED"', "Workflows")
        await asyncio.sleep(3)  # the list has answered by now
        assert run_id not in await browser.text()
