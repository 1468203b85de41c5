"""An asyncio inference loop: while decode step n runs on the device, the event loop serves other work.

Two requests share one device: a SmolLM2 greedy decode (awaiting each step's token read, which yields
to the event loop instead of blocking) and a 'housekeeping' task doing host work in small slices. The
output shows how much host work got done while tokens were being produced.

    python examples/async_decode.py --tokens 8
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

import batchgpu as bg
from batchgpu.models.llama import Llama

PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is"


async def decode(model: Llama, tokens: int, log: list[str]) -> list[int]:
    ids = []
    started = time.perf_counter()
    async for token in model.generate_async(PROMPT, tokens):
        ids.append(token)
        log.append(f"{time.perf_counter() - started:6.2f} s  token {token}")
    return ids


async def housekeeping(stop: asyncio.Event) -> int:
    """Host work in slices (here: small numpy reductions), yielding between slices."""
    slices = 0
    data = np.random.default_rng(0).standard_normal(4096)
    while not stop.is_set():
        float(np.sort(data).sum())
        slices += 1
        await asyncio.sleep(0)
    return slices


async def main_async(tokens: int) -> None:
    model = Llama(bg.Device(), quantized=True, max_context=128)
    log: list[str] = []
    stop = asyncio.Event()
    side = asyncio.create_task(housekeeping(stop))
    ids = await decode(model, tokens, log)
    stop.set()
    slices = await side
    print("\n".join(log))
    print(f"greedy ids {ids}")
    print(f"host work slices done by another task while decoding: {slices}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8)
    asyncio.run(main_async(parser.parse_args().tokens))


if __name__ == "__main__":
    main()
