"""Headless Chromium (Debian's `chromium`) driven over the DevTools protocol: open a page, wait until
it shows some text, take a screenshot. A plain `chromium --screenshot` of a running workflow's page
in the Temporal web UI never returns: the UI keeps a long poll open, so the page never finishes
loading. Over the protocol the test decides when the page shows what it came for.

    async with open_browser(tmp_path) as browser:
        await browser.open("http://127.0.0.1:8233/namespaces/default/workflows")
        text = await browser.wait_for("run-gpt-small")
        await browser.screenshot(tmp_path / "list.png")
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import websockets

from stayalive.workers.devstack import end_process

# As the workplace's notes say: without the background-networking flags Chromium keeps dialling
# Google's services, which a closed network refuses, many at a time.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1600,1300",
    "--remote-debugging-port=0",
]


# The page's text and its frames' (the web UI renders a workflow's current details in an iframe).
PAGE_TEXT = """(() => {
  let text = document.body ? document.body.innerText : '';
  for (const frame of document.querySelectorAll('iframe')) {
    try { text += '\\n' + frame.contentDocument.body.innerText; } catch (e) {}
  }
  return text;
})()"""


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self, socket: websockets.ClientConnection) -> None:
        self.socket = socket
        self.ids = itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command and its result (the events in between are not needed here)."""
        call_id = next(self.ids)
        await self.socket.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(await self.socket.recv())
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message["result"]
                return result

    async def open(self, url: str) -> None:
        await self.call("Page.navigate", url=url)

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page."""
        answer = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return answer["result"].get("value")

    async def text(self) -> str:
        return str(await self.evaluate(PAGE_TEXT) or "")

    async def wait_for(self, *needles: str, timeout: float = 45.0) -> str:
        """The page's text once it shows every one of `needles`; else fail, naming what it never showed."""
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = await self.text()
            if all(needle in text for needle in needles):
                return text
            await asyncio.sleep(0.5)
        missing = [needle for needle in needles if needle not in text]
        raise AssertionError(f"the page never showed {missing}; it showed:\n{text[-3000:]}")

    async def click(self, label: str) -> None:
        """Click the first button or link whose text is `label`."""
        script = (
            "(() => { const el = [...document.querySelectorAll('button, a')]"
            f".find(e => e.innerText.trim() === {json.dumps(label)}); if (el) {{ el.click(); return true; }}"
            " return false; })()"
        )
        if not await self.evaluate(script):
            raise AssertionError(f"no button or link reads {label!r}")

    async def scroll_to(self, text: str) -> None:
        """Bring the innermost element showing `text` to the middle of the window."""
        script = (
            "(() => { const all = [...document.querySelectorAll('body *')]"
            f".filter(e => e.innerText && e.innerText.includes({json.dumps(text)}));"
            " const el = all[all.length - 1]; if (!el) return false;"
            " el.scrollIntoView({block: 'center'});"
            " for (let p = el; p; p = p.parentElement) p.scrollLeft = 0;"  # only up and down: keep the left edge
            " return true; })()"
        )
        if not await self.evaluate(script):
            raise AssertionError(f"nothing on the page shows {text!r}")

    async def screenshot(self, path: Path) -> None:
        shot = await self.call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))


@contextlib.asynccontextmanager
async def open_browser(profile: Path) -> AsyncIterator[Browser]:
    """Chromium with a fresh profile in `profile`, and a connection to its one page."""
    binary = chromium()
    if binary is None:
        raise RuntimeError("chromium is not installed: apt-get install chromium")
    profile.mkdir(parents=True, exist_ok=True)
    (profile / "DevToolsActivePort").unlink(missing_ok=True)  # a profile used before names an old port
    with open(profile / "chromium.log", "wb") as log:
        process = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=os.environ | {"HOME": str(profile)},
        )
    try:
        port = await _devtools_port(profile, process)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as answer:
            pages = [target for target in json.load(answer) if target["type"] == "page"]
        async with websockets.connect(pages[0]["webSocketDebuggerUrl"], max_size=None) as socket:
            yield Browser(socket)
    finally:
        end_process(process, timeout=10)


async def _devtools_port(profile: Path, process: subprocess.Popen[bytes], timeout: float = 30.0) -> int:
    """The port Chromium chose: the first line of DevToolsActivePort in its profile."""
    deadline = time.monotonic() + timeout
    path = profile / "DevToolsActivePort"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"chromium exited with {process.returncode}; see {profile / 'chromium.log'}")
        if path.exists() and (lines := path.read_text().split()):
            return int(lines[0])
        await asyncio.sleep(0.1)
    raise RuntimeError(f"chromium opened no DevTools port within {timeout:g}s")
