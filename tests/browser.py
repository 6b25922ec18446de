"""Headless Chromium for the page tests, driven through chromedriver's W3C WebDriver API.

Debian's `chromium` and `chromium-driver` packages (`.ci/run` installs them); no Python client library:
WebDriver is JSON over HTTP, and the few calls a test needs are below. Where either program is missing,
`browser_missing()` says so and the tests skip with that reason.
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

CHROMIUM_FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,1000",
]
ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C key of an element reference
WAIT_S = 120.0  # how long a condition may take on a loaded machine before the test fails


def _program(name: str) -> str | None:
    return shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)


def browser_missing() -> str | None:
    """Why the page tests cannot run here, or None when Chromium and ChromeDriver are both installed."""
    missing = [name for name in ("chromium", "chromedriver") if _program(name) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (Debian packages chromium, chromium-driver)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Browser:
    """One headless Chromium session; use as a context manager."""

    def __init__(self, workdir: Path) -> None:
        driver = _program("chromedriver")
        chromium = _program("chromium")
        if driver is None or chromium is None:
            raise RuntimeError(browser_missing() or "no browser")
        self.port = _free_port()
        self.log = workdir / "chromedriver.log"
        self._driver = subprocess.Popen(
            [driver, f"--port={self.port}", f"--log-path={self.log}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._base = f"http://127.0.0.1:{self.port}"
        self._until(lambda: self._ready(), "chromedriver to answer /status")
        caps = {
            "capabilities": {
                "alwaysMatch": {
                    "browserName": "chrome",
                    "goog:loggingPrefs": {"browser": "ALL"},
                    "goog:chromeOptions": {
                        "binary": chromium,
                        "args": [*CHROMIUM_FLAGS, f"--user-data-dir={workdir / 'profile'}"],
                    },
                }
            }
        }
        self.session = self._call("POST", "/session", caps)["sessionId"]

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):  # the driver is killed below either way
            self._call("DELETE", f"/session/{self.session}")
        self._driver.terminate()
        try:
            self._driver.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._driver.kill()
            self._driver.wait()

    # --- WebDriver calls -----------------------------------------------------------------------------
    def _ready(self) -> bool:
        if self._driver.poll() is not None:
            raise RuntimeError(f"chromedriver exited with {self._driver.returncode}; see {self.log}")
        try:
            return bool(self._call("GET", "/status").get("ready"))
        except (urllib.error.URLError, ConnectionError):
            return False

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body if body is not None else {}).encode() if method == "POST" else None
        request = urllib.request.Request(
            self._base + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=WAIT_S) as response:
                return json.loads(response.read() or b"{}").get("value")
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"WebDriver {method} {path}: {e.code} {e.read()[:500]!r}") from None

    def _s(self, path: str) -> str:
        return f"/session/{self.session}{path}"

    def get(self, url: str) -> None:
        self._call("POST", self._s("/url"), {"url": url})

    def find(self, css: str) -> str:
        """The element matching a CSS selector (waits for it to appear)."""
        found: list[str] = []

        def present() -> bool:
            hits = self._call("POST", self._s("/elements"), {"using": "css selector", "value": css})
            if hits:
                found.append(hits[0][ELEMENT])
            return bool(hits)

        self._until(present, f"an element {css!r}")
        return found[0]

    def click(self, css: str) -> None:
        self._call("POST", self._s(f"/element/{self.find(css)}/click"))

    def type(self, css: str, text: str, *, clear: bool = True) -> None:
        element = self.find(css)
        if clear:
            self._call("POST", self._s(f"/element/{element}/clear"))
        self._call("POST", self._s(f"/element/{element}/value"), {"text": text})

    def text(self, css: str) -> str:
        return str(self._call("GET", self._s(f"/element/{self.find(css)}/text")))

    def run(self, script: str, *args: Any) -> Any:
        """Run JavaScript in the page (`return ...` gives the value back)."""
        return self._call("POST", self._s("/execute/sync"), {"script": script, "args": list(args)})

    def wait_for(self, script: str, what: str, *args: Any) -> Any:
        """Wait until the JavaScript expression `script` returns something truthy; return it."""
        seen: list[Any] = []

        def truthy() -> bool:
            value = self.run(script, *args)
            seen[:] = [value]
            return bool(value)

        self._until(truthy, what)
        return seen[0]

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self._call("GET", self._s("/screenshot"))))
        return path

    def console_errors(self) -> list[str]:
        """SEVERE entries of the browser's console since the last call (script errors, failed loads)."""
        entries = self._call("POST", self._s("/se/log"), {"type": "browser"}) or []
        return [str(e.get("message")) for e in entries if e.get("level") == "SEVERE"]

    def _until(self, condition: Any, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {WAIT_S:.0f} s for {what}")
            time.sleep(0.05)
