"""Servers the tests start: ``python -m batchgpu serve`` on 127.0.0.1 at a free port, its stderr drained on
a thread (so it never blocks on a full pipe), waited for with a deadline, and stopped at the end; and raw
connections to them, which a test closes when it wants the client gone."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def batchgpu_server(*options: str, startup: float = 300.0, env: dict[str, str] | None = None) -> Iterator[str]:
    """``python -m batchgpu serve OPTIONS --host 127.0.0.1 --port <free>`` (``env``: variables set for it);
    yields its base URL (no /v1) once uvicorn says it runs (AssertionError with its log if it exits or
    takes longer than ``startup``)."""
    with serve_process(*options, startup=startup, env=env) as (url, _):
        yield url


@contextmanager
def serve_process(
    *options: str, startup: float = 300.0, env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """:func:`batchgpu_server`, yielding its process too (benchmarks read its CPU time)."""
    port = free_port()
    command = [sys.executable, "-m", "batchgpu", "serve", *options, "--host", "127.0.0.1", "--port", str(port)]
    environment = {**os.environ, **(env or {})}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=environment)
    assert process.stderr is not None
    lines: queue.Queue[str | None] = queue.Queue()

    def pump(stream=process.stderr) -> None:  # uvicorn logs to stderr
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline, seen = time.monotonic() + startup, []
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError("the server did not start in time:\n" + "".join(seen)) from None
            if line is None:
                raise AssertionError(f"the server exited ({process.wait()}):\n" + "".join(seen))
            seen.append(line)
            if "Uvicorn running on" in line:
                break
        yield f"http://127.0.0.1:{port}", process
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def opened(server: str, path: str, body: Any) -> socket.socket:
    """A connection to ``server`` (``http://host:port``) that has sent a POST of ``body`` (JSON) to ``path``
    and read nothing yet."""
    host, port = server.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)), timeout=60)
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
    connection.sendall(head.encode() + b"\r\n\r\n" + data)
    return connection


def first_event(connection: socket.socket) -> bytes:
    """What comes on ``connection`` up to a streamed answer's first server-sent event (AssertionError if the
    answer is not a 200 or ends first)."""
    answer = b""
    while b"\ndata: " not in answer:
        data = connection.recv(65536)
        assert data, answer
        answer += data
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    return answer


def server_pid(server: str) -> int:
    """The pid of this process's ``batchgpu serve`` child listening at ``server``'s port (its own processes, such
    as its engine's core process, and processes that ended are not it)."""
    import psutil

    port = server.rsplit(":", 1)[1]
    for process in psutil.Process().children(recursive=True):
        try:
            command = process.cmdline()
        except psutil.Error:  # ended meanwhile, or a zombie not yet reaped
            continue
        if "serve" in command and port in command:
            return process.pid
    raise AssertionError(f"no batchgpu serve at port {port} among this process's children")
