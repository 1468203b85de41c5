"""``benchmarks/serve.py --ray``: aggregate generated tokens/s of SmolLM2-135M served over HTTP, through
the OpenAI client, by the single-process server (``python -m batchgpu serve``) and by the Ray Serve
deployment (batchgpu.llm.ray_serve) with 1 and 2 replicas, at several numbers of concurrent streamed
requests, in one run. Each server is started, warmed up by an untimed round of the largest level (4
tokens a request, so that every replica has run its steps before the timed rounds), measured, and
stopped; Ray runs as a local cluster (127.0.0.1) started here, each replica with an even share of the
CPUs (Ray gives it as many BLAS threads). The Ray path's overhead is its 1-replica tokens/s against the
single-process server's."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests/servers.py
from tests.servers import batchgpu_server, free_port

PROMPTS = ["The capital of France is", "Once upon a time", "Water boils at", "My favourite book is"]


async def http_level(base_url: str, concurrency: int, tokens: int) -> float:
    """Aggregate tokens/s of ``concurrency`` streamed completions submitted at once."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", timeout=600, max_retries=0)
    model = (await client.models.list()).data[0].id  # the served name: another one is refused (404)

    async def one(i: int) -> int:
        stream = await client.completions.create(
            model=model, prompt=f"{PROMPTS[i % len(PROMPTS)]} ({i})", max_tokens=tokens, temperature=0, stream=True,
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


@contextmanager
def single_process(device: str, max_batch: int, max_context: int, cpus: int | None) -> Iterator[str]:
    """The one-process server; ``cpus``: its BLAS threads (None: numpy's default, every core)."""
    options = ["--device", device, "--max-batch", str(max_batch), "--max-context", str(max_context)]
    threads = {} if cpus is None else {"OMP_NUM_THREADS": str(cpus), "OPENBLAS_NUM_THREADS": str(cpus)}
    with batchgpu_server(*options, startup=600, env=threads) as base_url:
        yield f"{base_url}/v1"


@contextmanager
def ray_cluster(device: str, replicas: int, max_batch: int, max_context: int, cpus: int | None) -> Iterator[str]:
    """A local Ray cluster serving ``replicas`` engines of ``cpus`` CPUs each (None: an even share)."""
    import ray
    from ray import serve

    from batchgpu.llm.options import EngineOptions
    from batchgpu.llm.ray_serve import build_app
    from batchgpu.models.llama import smollm2_path

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        options = EngineOptions(model=str(smollm2_path()), device=device, max_batch=max_batch, max_context=max_context)
        app = build_app(options, replicas=replicas, model_name="m", cpus_per_replica=cpus)
        serve.run(app, name="bench")  # returns once the application runs
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        serve.shutdown()
        ray.shutdown()


def run(devices: list[str], levels: list[int], tokens: int, engine_cpus: int | None) -> list[dict[str, object]]:
    """One row per (device, server, concurrency); ``engine_cpus``: the CPUs (BLAS threads) of the
    one-process server and of the 1-replica engine (None: all of them; the 2 replicas split them)."""
    rows: list[dict[str, object]] = []
    max_batch, max_context = max(levels), 32 + tokens
    for device in devices:
        servers = {
            "single process": (single_process, (device, max_batch, max_context, engine_cpus)),
            "ray, 1 replica": (ray_cluster, (device, 1, max_batch, max_context, engine_cpus)),
            "ray, 2 replicas": (ray_cluster, (device, 2, max_batch, max_context, None)),
        }
        for label, (start, settings) in servers.items():
            with start(*settings) as base_url:
                asyncio.run(http_level(base_url, max(levels), 4))  # warm-up: every replica, every step size
                for concurrency in levels:
                    tokens_per_s = asyncio.run(http_level(base_url, concurrency, tokens))
                    rows.append(dict(device=device, server=label, concurrency=concurrency, tokens_per_s=tokens_per_s))
                    print(f"| {device} | {label} | {concurrency} | {tokens_per_s:.1f} |", flush=True)
    return rows
