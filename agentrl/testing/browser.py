"""Headless Chromium driven over its DevTools protocol (a websocket, through aiohttp): load a page,
evaluate JavaScript, wait for a condition, take a screenshot. For the viewer's browser test and bench.

``chromium_path()`` finds Debian's ``chromium`` (``apt-get install chromium``). The browser runs with a
fresh profile in a temp dir of its own (removed on exit), no sandbox (containers run as root), no GPU, and
nothing that reaches the network on its own (no sync, updates or background fetches); it listens for the
protocol on loopback only.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
]
_LISTENING = re.compile(r"DevTools listening on (ws://\S+)")


def chromium_path() -> str | None:
    """The Chromium executable (``$CHROMIUM``, else ``chromium`` / ``chromium-browser`` on PATH)."""
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Chromium:
    """``async with Chromium() as page:`` -- one headless browser and one page (tab) of it."""

    def __init__(self, width: int = 1400, height: int = 900, executable: str | None = None) -> None:
        self.executable = executable or chromium_path()
        if self.executable is None:
            raise FileNotFoundError("no chromium executable (apt-get install chromium, or set CHROMIUM)")
        self.size = (width, height)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._events: list[dict[str, Any]] = []

    async def __aenter__(self) -> Chromium:
        self._tmp = tempfile.mkdtemp(prefix="agentrl-chromium-")
        profile = Path(self._tmp) / "profile"
        self.proc = self._launch(profile)
        try:
            browser_ws = await asyncio.wait_for(asyncio.to_thread(self._listening_url), 60)
            port = int(re.search(r":(\d+)/", browser_ws).group(1))  # type: ignore[union-attr]
            self._http = aiohttp.ClientSession()
            async with self._http.get(f"http://127.0.0.1:{port}/json/list") as r:
                targets = await r.json()
            page = next(t for t in targets if t.get("type") == "page")
            self._ws = await self._http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
            self._reader = asyncio.create_task(self._read())
            await self.send("Page.enable")
            await self.send("Runtime.enable")
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    def _launch(self, profile: Path) -> subprocess.Popen:
        env = {**os.environ, "TMPDIR": self._tmp, "HOME": self._tmp}  # its scratch files stay in our dir
        width, height = self.size
        return subprocess.Popen(
            [
                self.executable,
                *FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,  # its own process group: its helpers (zygote, renderers) go with it
        )

    def _listening_url(self) -> str:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            m = _LISTENING.search(line)
            if m:
                # keep draining stderr so the browser never blocks on a full pipe
                threading_drain(self.proc.stderr)
                return m.group(1)
        raise RuntimeError(f"chromium exited (code {self.proc.wait()}) before listening")

    async def _read(self) -> None:
        async for msg in self._ws:
            data = json.loads(msg.data)
            fut = self._pending.pop(data.get("id", -1), None)
            if fut is not None and not fut.done():
                fut.set_result(data)
            elif "method" in data:
                self._events.append(data)

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        """One protocol command; its result (raises RuntimeError with the browser's error)."""
        i = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[i] = fut
        await self._ws.send_str(json.dumps({"id": i, "method": method, "params": params}))
        data = await asyncio.wait_for(fut, 120)
        if "error" in data:
            raise RuntimeError(f"{method}: {data['error']}")
        return data.get("result", {})

    async def goto(self, url: str, timeout: float = 120) -> None:
        """Navigate and wait for the load event."""
        self._events.clear()
        await self.send("Page.navigate", url=url)
        await self.wait_event("Page.loadEventFired", timeout)

    async def wait_event(self, method: str, timeout: float = 60) -> dict[str, Any]:
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            for e in self._events:
                if e["method"] == method:
                    return e
            await asyncio.sleep(0.02)
        raise TimeoutError(f"no {method} within {timeout} s")

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (awaited when it is a promise); page errors raise."""
        res = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in res:
            raise RuntimeError(
                f"page error: {res['exceptionDetails'].get('exception', {}).get('description')}"
            )
        return res["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 60) -> Any:
        """Poll a JavaScript expression until it is truthy; its value."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{expression!r} not true within {timeout} s")
            await asyncio.sleep(0.05)

    async def screenshot(self, path: str | Path) -> Path:
        """A PNG of the viewport."""
        res = await self.send("Page.captureScreenshot", format="png")
        Path(path).write_bytes(base64.b64decode(res["data"]))
        return Path(path)

    def page_errors(self) -> list[str]:
        """Uncaught exceptions the page threw so far."""
        return [
            e["params"]["exceptionDetails"].get("exception", {}).get("description", "")
            for e in self._events
            if e["method"] == "Runtime.exceptionThrown"
        ]

    async def __aexit__(self, *exc: object) -> None:
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.cancel()
        ws = getattr(self, "_ws", None)
        if ws is not None:
            await ws.close()
        http = getattr(self, "_http", None)
        if http is not None:
            await http.close()
        self.proc.terminate()
        try:
            await asyncio.to_thread(self.proc.wait, 20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)
        # helper processes can outlive the browser's main one and still write into the profile while it is
        # removed (a directory that gains a file cannot be deleted): end the whole group first, then remove
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for _ in range(50):
            shutil.rmtree(self._tmp, ignore_errors=True)
            if not os.path.exists(self._tmp):
                break
            await asyncio.sleep(0.1)


def threading_drain(stream: Any) -> None:
    """Read ``stream`` to its end in a daemon thread."""
    import threading

    threading.Thread(target=lambda: [None for _ in stream], daemon=True).start()
