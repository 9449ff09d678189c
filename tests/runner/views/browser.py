"""Headless Chromium (Debian's `chromium`) driven over the Chrome DevTools Protocol: open a page,
evaluate JavaScript in it (awaiting a promise), take a screenshot. The tests skip, saying why,
where no chromium is installed (apt-get install chromium)."""

from __future__ import annotations

import base64
import itertools
import json
import re
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from websockets.sync.client import connect

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium here: apt-get install chromium "
                                                             "(the dashboard's browser tests drive it)")


class Browser:
    """One headless Chromium and one page of it."""

    def __init__(self, width: int = 1280, height: int = 900) -> None:
        self._profile = tempfile.TemporaryDirectory(prefix="grpo-run-chromium-")
        self.proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                      "--remote-debugging-port=0", f"--user-data-dir={self._profile.name}",
                                      f"--window-size={width},{height}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for line in self.proc.stderr:       # "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/..."
            found = re.search(r"ws://127\.0\.0\.1:(\d+)/", line)
            if found:
                break
        else:
            raise RuntimeError("chromium exited before it listened")
        with urllib.request.urlopen(f"http://127.0.0.1:{found.group(1)}/json/list", timeout=30) as r:
            target = next(t for t in json.load(r) if t["type"] == "page")
        self.ws = connect(target["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
        self._ids = itertools.count(1)
        # the page's size: headless chromium's window size is not always its viewport's
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        mine = next(self._ids)
        self.ws.send(json.dumps({"id": mine, "method": method, "params": params}))
        while True:                          # events arrive between the answers: skipped
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == mine:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def until(self, js: str, timeout_s: float = 30) -> Any:
        """The value of the JavaScript expression `js` once it is truthy (polled in the page)."""
        probe = (f"new Promise((ok, no) => {{ const t0 = Date.now(); (function again() {{ let v; try {{ v = ({js}); }}"
                 f" catch (e) {{ v = null; }} if (v) return ok(v); if (Date.now() - t0 > {timeout_s * 1000})"
                 f" return no(new Error('never true: ' + {json.dumps(js)})); setTimeout(again, 50); }})(); }})")
        got = self.call("Runtime.evaluate", expression=probe, awaitPromise=True, returnByValue=True)
        if got.get("exceptionDetails"):
            raise AssertionError(got["exceptionDetails"].get("exception", {}).get("description"))
        return got["result"].get("value")

    def screenshot(self, path: Path) -> None:
        shot = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(shot["data"]))

    def close(self) -> None:
        self.ws.close()
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self._profile.cleanup()
