"""``benchmarks/serve.py --ray``: aggregate generated tokens/s of SmolLM2-135M served over HTTP, through
the OpenAI client, by the single-process server (``python -m batchgpu serve``) and by the Ray Serve
deployment (batchgpu.llm.ray_serve) with 1 and 2 replicas, at several numbers of concurrent streamed
requests, in one run. Each server is started, warmed up by one request, measured, and stopped; Ray runs
as a local cluster (127.0.0.1) started here. The Ray path's overhead is its 1-replica tokens/s against the
single-process server's."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

PROMPTS = ["The capital of France is", "Once upon a time", "Water boils at", "My favourite book is"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def http_level(base_url: str, concurrency: int, tokens: int) -> float:
    """Aggregate tokens/s of ``concurrency`` streamed completions submitted at once."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", timeout=600, max_retries=0)

    async def one(i: int) -> int:
        stream = await client.completions.create(
            model="m", prompt=f"{PROMPTS[i % len(PROMPTS)]} ({i})", max_tokens=tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
        )  # fmt: skip
        used = 0
        async for chunk in stream:
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
        return used

    try:
        started = time.perf_counter()
        generated = sum(await asyncio.gather(*(one(i) for i in range(concurrency))))
        return generated / (time.perf_counter() - started)
    finally:
        await client.close()


def wait_for(base_url: str, timeout: float = 600) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{base_url}/models", timeout=5).read()
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"no server at {base_url} after {timeout} s")


@contextmanager
def single_process(device: str, max_batch: int, max_context: int) -> Iterator[str]:
    port = free_port()
    command = [sys.executable, "-m", "batchgpu", "serve", "--device", device, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--max-batch", str(max_batch), "--max-context", str(max_context)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base_url = f"http://127.0.0.1:{port}/v1"
        wait_for(base_url)
        yield base_url
    finally:
        server.terminate()
        server.wait(30)


@contextmanager
def ray_cluster(device: str, replicas: int, max_batch: int, max_context: int) -> Iterator[str]:
    import ray
    from ray import serve

    from batchgpu.llm.ray_serve import EngineOptions, build_app
    from batchgpu.models.llama import smollm2_path

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        options = EngineOptions(model=str(smollm2_path()), device=device, max_batch=max_batch, max_context=max_context)
        serve.run(build_app(options, replicas=replicas, model_name="m"), name="bench", blocking=False)
        base_url = f"http://127.0.0.1:{port}/v1"
        wait_for(base_url)
        yield base_url
    finally:
        serve.shutdown()
        ray.shutdown()


def run(devices: list[str], levels: list[int], tokens: int) -> list[dict[str, object]]:
    """One row per (device, server, concurrency)."""
    rows: list[dict[str, object]] = []
    max_batch, max_context = max(levels), 32 + tokens
    for device in devices:
        servers = {
            "single process": (single_process, (device, max_batch, max_context)),
            "ray, 1 replica": (ray_cluster, (device, 1, max_batch, max_context)),
            "ray, 2 replicas": (ray_cluster, (device, 2, max_batch, max_context)),
        }
        for label, (start, settings) in servers.items():
            with start(*settings) as base_url:
                asyncio.run(http_level(base_url, 1, 4))  # warm-up: recordings, compiles
                for concurrency in levels:
                    tokens_per_s = asyncio.run(http_level(base_url, concurrency, tokens))
                    rows.append(dict(device=device, server=label, concurrency=concurrency, tokens_per_s=tokens_per_s))
                    print(f"| {device} | {label} | {concurrency} | {tokens_per_s:.1f} |", flush=True)
    return rows
