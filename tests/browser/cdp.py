"""Headless Chromium driven over the DevTools protocol (CDP) with websocket-client: launch, open a page, run
script in it, click / hover at an element, take a screenshot."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import tempfile
import time
from typing import Any, Optional

import requests
import websocket

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
_START_TIMEOUT_S = 60


def find_chromium() -> Optional[str]:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


class CDPError(RuntimeError):
    pass


class Browser:
    """One headless Chromium process; `new_page()` opens a tab to drive."""

    def __init__(self, executable: str, width: int = 1400, height: int = 1000):
        self.profile = tempfile.TemporaryDirectory(prefix="braid-chromium-")
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
        self.proc = subprocess.Popen(
            [executable, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--remote-debugging-port=0", "--remote-allow-origins=*", f"--user-data-dir={self.profile.name}",
             f"--window-size={width},{height}", "--no-first-run", "--hide-scrollbars", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.port = self._devtools_port()

    def _devtools_port(self) -> int:
        deadline = time.time() + _START_TIMEOUT_S
        seen = []
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                break
            seen.append(line)
            m = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
            if m:
                return int(m.group(1))
        self.close()
        raise CDPError("chromium did not start:\n" + "".join(seen[-20:]))

    def new_page(self) -> "Page":
        resp = requests.put(f"http://127.0.0.1:{self.port}/json/new?about:blank", timeout=30)
        resp.raise_for_status()
        return Page(resp.json()["webSocketDebuggerUrl"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.profile.cleanup()


class Page:
    def __init__(self, ws_url: str):
        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self._ids = 0
        self.events: list[dict] = []
        self.send("Page.enable")
        self.send("Runtime.enable")

    def send(self, method: str, **params: Any) -> dict:
        self._ids += 1
        my_id = self._ids
        self.ws.send(json.dumps({"id": my_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == my_id:
                if "error" in msg:
                    raise CDPError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def set_headers(self, headers: dict) -> None:
        self.send("Network.enable")
        self.send("Network.setExtraHTTPHeaders", headers=headers)

    def goto(self, url: str, timeout: float = 60) -> None:
        result = self.send("Page.navigate", url=url)
        if result.get("errorText"):
            raise CDPError(f"navigating to {url}: {result['errorText']}")
        self.wait_for("document.readyState === 'complete'", timeout)

    def eval(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise CDPError(f"script error in {expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30, interval: float = 0.1) -> Any:
        deadline = time.time() + timeout
        while True:
            value = self.eval(expression)
            if value:
                return value
            if time.time() > deadline:
                raise CDPError(f"timed out after {timeout} s waiting for {expression}")
            time.sleep(interval)

    def center_of(self, selector: str) -> tuple[float, float]:
        """The viewport centre of the first element matching `selector`, scrolled into view."""
        box = self.eval(f"""(() => {{ const e = document.querySelector({json.dumps(selector)});
            if (!e) return null; e.scrollIntoView({{block: 'center'}}); const r = e.getBoundingClientRect();
            return [r.left + r.width / 2, r.top + r.height / 2]; }})()""")
        if box is None:
            raise CDPError(f"no element matches {selector}")
        return box[0], box[1]

    def hover(self, selector: str) -> None:
        x, y = self.center_of(selector)
        self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    def click(self, selector: str) -> None:
        x, y = self.center_of(selector)
        self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def screenshot(self, full_page: bool = True) -> bytes:
        params: dict = {"format": "png"}
        if full_page:
            params["captureBeyondViewport"] = True
        return base64.b64decode(self.send("Page.captureScreenshot", **params)["data"])

    def close(self) -> None:
        self.ws.close()
