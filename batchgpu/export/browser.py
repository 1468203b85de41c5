"""Run an exported WebGPU program in headless Chromium: serve the folder on 127.0.0.1, open a page
and await a JavaScript Promise through the DevTools protocol over a pipe (``--remote-debugging-pipe``).

    python -m batchgpu.export.browser out_dir          # prints the page's result JSON; exit 1 unless "pass"

Chromium's ``--dump-dom --virtual-time-budget`` does not wait for GPU work (virtual time runs out while
the page awaits ``onSubmittedWorkDone`` or ``mapAsync``), so this awaits the page's own Promise instead,
in real time, which also makes the page's timings real.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import functools
import http.server
import itertools
import json
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
ENV_CHROMIUM = "BATCHGPU_CHROMIUM"

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
    "--enable-unsafe-webgpu",
)
"""Flags that give headless Chromium a WebGPU adapter (SwiftShader, vendor "google", on machines
without a GPU) and keep it off the network."""

RESULT_EXPRESSION = "window.batchgpuResult"

CUT_PAUSE_S = 0.3
"""How long a response that :class:`ServeLog` cuts stalls before its connection drops."""

CROSS_ORIGIN_ISOLATION = {"Cross-Origin-Opener-Policy": "same-origin", "Cross-Origin-Embedder-Policy": "require-corp"}
"""Headers that make a same-origin page cross-origin isolated (``self.crossOriginIsolated``): what
``SharedArrayBuffer``, and so WebAssembly threads, need. For :func:`serve`'s ``headers``."""


class BrowserError(RuntimeError):
    """Chromium could not be started, crashed, or the page did not answer in time."""


def find_chromium() -> str | None:
    """``$BATCHGPU_CHROMIUM`` or the first Chromium/Chrome on PATH."""
    configured = os.environ.get(ENV_CHROMIUM)
    if configured:
        return shutil.which(configured) or (configured if os.path.isfile(configured) else None)
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


class ServeLog:
    """What :func:`serve` answered, request by request, and the faults it was asked to inject: ``cut`` maps a
    file's path in the folder (``"model.gguf"``) to a byte count, after which the first response for that file
    is cut off (its connection closed early, as a dropped download). Pass one as ``serve(..., log=...)``."""

    def __init__(self, cut: Mapping[str, int] | None = None) -> None:
        self.requests: list[dict[str, Any]] = []
        self.cut = dict(cut or {})
        self._lock = threading.Lock()

    def add(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self.requests.append(entry)

    def take_cut(self, name: str) -> int | None:
        """The byte count at which to cut this response for ``name`` (only once)."""
        with self._lock:
            return self.cut.pop(name, None)

    def sent(self, name: str) -> int:
        """Body bytes sent for the file ``name`` so far, over every request."""
        with self._lock:
            return sum(r["bytes"] for r in self.requests if r["path"] == name)

    def of(self, name: str) -> list[dict[str, Any]]:
        """The requests for ``name``: ``{"path", "range", "status", "bytes"}`` each."""
        with self._lock:
            return [dict(r) for r in self.requests if r["path"] == name]


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``[start, end)`` of a single ``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` range of a ``size``-byte file;
    None for no (or an unsupported) range, which is answered with the whole file; ValueError for a range that
    starts past the end (416)."""
    if not header or not header.startswith("bytes=") or "," in header:
        return None
    first, _, last = header[len("bytes=") :].strip().partition("-")
    try:
        if not first:  # the last n bytes
            return max(size - int(last), 0), size
        start = int(first)
        end = min(int(last) + 1, size) if last else size
    except ValueError:
        return None
    if start >= size or end <= start:
        raise ValueError(header)
    return start, end


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Static files with single byte ranges (``Range: bytes=a-``: 206 Partial Content, which a resumed
    download asks for), each file request logged to the server's :class:`ServeLog` where it has one."""

    extensions_map = {  # noqa: RUF012 - the base class's mapping, extended
        **http.server.SimpleHTTPRequestHandler.extensions_map,
        ".js": "text/javascript",
        ".wgsl": "text/plain",
        ".json": "application/json",
    }

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def end_headers(self) -> None:
        self.send_header("Cache-Control", "no-store")
        for name, value in self.server.extra_headers.items():
            self.send_header(name, value)
        super().end_headers()

    def do_GET(self) -> None:
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            super().do_GET()  # folders, 404s
            return
        name = os.path.relpath(path, self.directory).replace(os.sep, "/")
        size = os.path.getsize(path)
        header = self.headers.get("Range")
        entry: dict[str, Any] = {"path": name, "range": header, "status": 200, "bytes": 0}
        try:
            span = byte_range(header, size)
        except ValueError:
            entry["status"] = 416
            self._log(entry)
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start, end = span or (0, size)
        entry["status"] = 206 if span else 200
        self.send_response(entry["status"])
        self.send_header("Content-Type", self.guess_type(path))
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        if span:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        log = self.server.log
        cut = log.take_cut(name) if log is not None else None
        try:
            with open(path, "rb") as file:
                file.seek(start)
                left = end - start if cut is None else min(cut, end - start)
                while left > 0:
                    data = file.read(min(left, 1 << 16))
                    if not data:
                        break
                    self.wfile.write(data)
                    entry["bytes"] += len(data)
                    left -= len(data)
            if cut is not None:  # a dropped download: fewer bytes than Content-Length, then the connection ends
                self.wfile.flush()
                time.sleep(CUT_PAUSE_S)  # the bytes sent reach the page before the connection drops
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)
        finally:
            self._log(entry)

    def _log(self, entry: dict[str, Any]) -> None:
        if self.server.log is not None:
            self.server.log.add(entry)


class _Server(http.server.ThreadingHTTPServer):
    extra_headers: Mapping[str, str] = {}
    log: ServeLog | None = None

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Quiet about connections the browser dropped (a closed tab cancels its requests)."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@contextlib.contextmanager
def serve(
    folder: str | Path, *, headers: Mapping[str, str] | None = None, log: ServeLog | None = None
) -> Iterator[str]:
    """Serve ``folder`` over HTTP on 127.0.0.1 (a free port) in a thread; yields the base URL.
    localhost is a secure context, so pages there get ``navigator.gpu``. ``headers``: sent with every
    response besides the defaults (for instance :data:`CROSS_ORIGIN_ISOLATION`). Files are served with single
    byte ranges (a resumed download's ``Range: bytes=a-``); ``log`` records each file request and injects its
    ``cut`` faults."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = _Server(("127.0.0.1", 0), handler)
    server.extra_headers = dict(headers or {})
    server.log = log
    thread = threading.Thread(target=server.serve_forever, name="batchgpu-export-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class Chromium:
    """A headless Chromium driven through the DevTools protocol over ``--remote-debugging-pipe``."""

    def __init__(self, executable: str | None = None, flags: Sequence[str] = ()) -> None:
        self.executable = executable or find_chromium()
        if self.executable is None:
            raise BrowserError(f"no Chromium found (tried ${ENV_CHROMIUM}, {', '.join(CHROMIUM_NAMES)})")
        self._profile = tempfile.TemporaryDirectory(prefix="batchgpu-chromium-")
        self._log = open(os.path.join(self._profile.name, "chromium.log"), "w+b")  # noqa: SIM115 - closed in close()
        command_read, self._command_write = os.pipe()
        self._reply_read, reply_write = os.pipe()
        # the child's fds 3 and 4 are the pipe; move ours out of the way so the dup2s cannot collide
        child_in = fcntl.fcntl(command_read, fcntl.F_DUPFD_CLOEXEC, 10)
        child_out = fcntl.fcntl(reply_write, fcntl.F_DUPFD_CLOEXEC, 10)
        args = [
            self.executable,
            *CHROMIUM_FLAGS,
            *flags,
            "--remote-debugging-pipe",
            f"--user-data-dir={self._profile.name}",
            "about:blank",
        ]
        try:
            self.pid = os.posix_spawn(
                self.executable,
                args,
                os.environ,
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, self._log.fileno(), 1),
                    (os.POSIX_SPAWN_DUP2, self._log.fileno(), 2),
                    (os.POSIX_SPAWN_DUP2, child_in, 3),
                    (os.POSIX_SPAWN_DUP2, child_out, 4),
                ],
                setsid=True,  # its own process group: close() can end the renderer and GPU processes too
            )
        finally:
            for fd in (command_read, reply_write, child_in, child_out):
                os.close(fd)
        self._ids = itertools.count(1)
        self._buffer = b""
        self._closed = False

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log_tail(self, limit: int = 2000) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-limit:]

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30.0) -> Any:
        """Send one DevTools command and wait for its reply (events in between are dropped)."""
        message_id = next(self._ids)
        message: dict[str, Any] = {"id": message_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        try:
            os.write(self._command_write, json.dumps(message).encode() + b"\0")
        except BrokenPipeError:
            raise BrowserError(f"Chromium exited; its log ends with:\n{self.log_tail()}") from None
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buffer:
                left = deadline - time.monotonic()
                ready = select.select([self._reply_read], [], [], max(left, 0))[0] if left > 0 else []
                if not ready:
                    raise BrowserError(f"{method}: no answer from Chromium within {timeout:.0f} s")
                chunk = os.read(self._reply_read, 1 << 20)
                if not chunk:
                    raise BrowserError(f"Chromium exited during {method}; its log ends with:\n{self.log_tail()}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == message_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error'].get('message', reply['error'])}")
                return reply.get("result", {})

    def evaluate(
        self,
        url: str,
        expression: str = RESULT_EXPRESSION,
        timeout: float = 60.0,
        *,
        before: str | None = None,
        commands: Sequence[tuple[str, dict[str, Any]]] = (),
    ) -> Any:
        """Open ``url`` in a new tab, then await ``expression`` (a Promise, or a value) there; returns
        its JSON value. Waits for the page to define the expression's root object. ``before``: a script run in
        the page before its own scripts; ``commands``: DevTools commands (method, params) sent in the tab's
        session first, lasting as long as it (``("Storage.overrideQuotaForOrigin", {"origin": ..., "quotaSize":
        n})``: a nearly full disk)."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        try:
            session = self._attach(target)
            for method, params in commands:
                self.send(method, params, session)
            if before is not None:  # e.g. a test taking a browser feature away
                self.send("Page.enable", {}, session)
                self.send("Page.addScriptToEvaluateOnNewDocument", {"source": before}, session)
            return self._await_in(session, url, expression, timeout)
        finally:
            with contextlib.suppress(BrowserError):
                self.send("Target.closeTarget", {"targetId": target}, timeout=10)

    def screenshot(
        self, url: str, path: str | Path, expression: str = RESULT_EXPRESSION, timeout: float = 60.0, width: int = 900
    ) -> Any:
        """:meth:`evaluate`, then a PNG of the page (``width`` CSS pixels wide, as tall as its content) written to
        ``path``; returns the expression's value."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        try:
            session = self._attach(target)
            metrics = {"width": width, "height": 700, "deviceScaleFactor": 1, "mobile": False}
            self.send("Emulation.setDeviceMetricsOverride", metrics, session)
            value = self._await_in(session, url, expression, timeout)
            shot = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session)
            Path(path).write_bytes(base64.b64decode(shot["data"]))
            return value
        finally:
            with contextlib.suppress(BrowserError):
                self.send("Target.closeTarget", {"targetId": target}, timeout=10)

    def clear_storage(self, origin: str) -> None:
        """Remove everything ``origin`` (``http://127.0.0.1:PORT``) keeps in this browser's profile: its origin
        private file system, Cache API, IndexedDB, ... (an OS may hand a freed port out again)."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        try:
            params = {"origin": origin.rstrip("/"), "storageTypes": "all"}
            self.send("Storage.clearDataForOrigin", params, self._attach(target))
        finally:
            with contextlib.suppress(BrowserError):
                self.send("Target.closeTarget", {"targetId": target}, timeout=10)

    def _attach(self, target: str) -> str:
        return self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

    def _await_in(self, session: str, url: str, expression: str, timeout: float) -> Any:
        self.send("Page.navigate", {"url": url}, session)
        waiting = (
            "new Promise((resolve) => { const poll = () => { let v; try { v = (" + expression + "); } catch (e) {} "
            "if (v === undefined) setTimeout(poll, 20); else resolve(v); }; poll(); })"
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = self.send(
                    "Runtime.evaluate",
                    {"expression": waiting, "awaitPromise": True, "returnByValue": True},
                    session,
                    timeout=max(deadline - time.monotonic(), 0.1),
                )
                break
            except BrowserError as exc:  # the navigation replaced the context we evaluated in: try again
                if "context" not in str(exc).lower() or time.monotonic() > deadline:
                    raise
        if "exceptionDetails" in reply:
            details = reply["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise BrowserError(f"{url}: {text}")
        return reply["result"].get("value")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(BrowserError, OSError):
            self.send("Browser.close", timeout=5)
        deadline = time.monotonic() + 10
        while True:
            done, _ = os.waitpid(self.pid, os.WNOHANG)
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # leftovers of the group this Chromium leads
        if not done:
            os.waitpid(self.pid, 0)
        os.close(self._command_write)
        os.close(self._reply_read)
        self._log.close()
        self._profile.cleanup()


def run_page(
    folder: str | Path,
    page: str = "index.html",
    *,
    expression: str = RESULT_EXPRESSION,
    timeout: float = 60.0,
    chromium: str | None = None,
    flags: Sequence[str] = (),
) -> Any:
    """Serve ``folder``, open ``page`` (may carry a query string) in headless Chromium and return the
    JSON value of ``expression`` (default: the export page's ``window.batchgpuResult``)."""
    with serve(folder) as base, Chromium(chromium, flags) as browser:
        return browser.evaluate(base + page, expression, timeout)


def format_result(result: dict[str, Any]) -> str:
    """The export page's result as a small text table."""
    lines = [f"status: {result.get('status')}"]
    if "error" in result:
        lines.append(f"error: {result['error']}")
    adapter = result.get("adapter")
    if adapter:
        lines.append("adapter: " + " / ".join(v for v in adapter.values() if v))
    for output in result.get("outputs", []):
        lines.append(
            f"  {output['name']:<20} {output['dtype']:<8} max abs error {output['max_abs_error']:.2e}  "
            f"{'pass' if output['ok'] else 'FAIL'}"
        )
    for step, ms in result.get("timings", {}).items():
        lines.append(f"  {step:<45} {ms:9.2f} ms")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a batchgpu WebGPU export in headless Chromium.")
    parser.add_argument("folder", help="the folder export_webgpu wrote")
    parser.add_argument("--runs", type=int, default=10, help="timed runs after the checked one")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    result = run_page(args.folder, f"index.html?runs={args.runs}", timeout=args.timeout)
    print(json.dumps(result, indent=1) if args.json else format_result(result))
    return 0 if isinstance(result, dict) and result.get("status") == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
