"""SmolLM2-135M decode speed: batchgpu (fp32 and quantized weights) beside a numpy fp32 decode of the
same model, measured in one run on one machine, with the bandwidth floor of each.

    python benchmarks/decode.py [--tokens 10] [--device wgpu] [--json out.json]

Timed window: the decode steps after the first two. Prefill, recording, pipeline compiles, the first
decode step (which records and first runs the decode batch) and the second (where native executors
capture the plan into a CUDA/HIP graph) are warm-up and excluded; each decoder reports the median and
the mean of its steady steps. The machine's 1-minute load average is
printed beside the figures (the host is shared: compare decoders measured in the same run).

The floor is the weight bytes one token must read divided by the measured host memory bandwidth
(bytes read plus written per second by a numpy copy of a 256 MiB buffer): no decode that reads every
weight once can beat it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

import batchgpu as bg
from batchgpu.models.llama import GGUFWeights, Llama, smollm2_path

try:
    from machine_load import load_average
except ImportError:  # loaded by path (python -m batchgpu bench), not run as a script
    sys.path.append(str(Path(__file__).resolve().parent))
    from machine_load import load_average

PROMPT = [504, 3575, 282, 4649, 314]


class NumpyDecoder:
    """A plain numpy fp32 Llama decode with a KV cache (the baseline)."""

    def __init__(self, weights: GGUFWeights, max_context: int = 128) -> None:
        self.cfg = weights.config
        self.w = {name: weights.float32(name) for name in weights.names()}
        cfg = self.cfg
        self.k = np.zeros((cfg.layers, max_context, cfg.kv_heads, cfg.head_dim), np.float32)
        self.v = np.zeros_like(self.k)
        d = cfg.head_dim
        self.inv = (1.0 / np.float32(cfg.theta) ** (np.arange(0, d, 2, dtype=np.float32) / d)).astype(np.float32)

    def weight_bytes(self) -> int:
        return sum(a.nbytes for a in self.w.values())

    def _rms(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(self.cfg.eps)) * g

    def _rope(self, x: np.ndarray, pos: int) -> np.ndarray:
        ang = np.float32(pos) * self.inv
        cos, sin = np.cos(ang), np.sin(ang)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def step(self, token: int, pos: int) -> int:
        cfg, w = self.cfg, self.w
        d, group = cfg.head_dim, cfg.heads // cfg.kv_heads
        h = w["token_embd.weight"][token]
        for i in range(cfg.layers):
            b = f"blk.{i}."
            x = self._rms(h, w[b + "attn_norm.weight"])
            q = self._rope((w[b + "attn_q.weight"] @ x).reshape(cfg.heads, d), pos)
            self.k[i, pos] = self._rope((w[b + "attn_k.weight"] @ x).reshape(cfg.kv_heads, d), pos)
            self.v[i, pos] = (w[b + "attn_v.weight"] @ x).reshape(cfg.kv_heads, d)
            keys = np.repeat(self.k[i, : pos + 1], group, axis=1)
            values = np.repeat(self.v[i, : pos + 1], group, axis=1)
            s = np.einsum("hd,shd->hs", q, keys) / np.float32(math.sqrt(d))
            p = np.exp(s - s.max(-1, keepdims=True))
            att = np.einsum("hs,shd->hd", p / p.sum(-1, keepdims=True), values).reshape(-1)
            h = h + w[b + "attn_output.weight"] @ att
            x = self._rms(h, w[b + "ffn_norm.weight"])
            g, u = w[b + "ffn_gate.weight"] @ x, w[b + "ffn_up.weight"] @ x
            h = h + w[b + "ffn_down.weight"] @ (g / (1 + np.exp(-g)) * u)
        return int(np.argmax(w["token_embd.weight"] @ self._rms(h, w["output_norm.weight"])))

    def generate(self, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
        """Greedy ids and the seconds of each token after the first (the prompt's steps run first)."""
        for pos, token in enumerate(prompt[:-1]):
            self.step(token, pos)
        token, pos = prompt[-1], len(prompt) - 1

        def tokens_out() -> Iterator[int]:
            nonlocal token, pos
            for _ in range(tokens):
                token = self.step(token, pos)
                pos += 1
                yield token

        return steady_steps(tokens_out())


WARM_TOKENS = 3
"""Untimed tokens: the prompt's, the first decode step's (recording, compiles, first run) and the
second's (native executors capture their graph on a plan's second run)."""


def steady_steps(ids: Iterator[int]) -> tuple[list[int], list[float]]:
    """Consume a token stream; the seconds of each token after the first WARM_TOKENS."""
    out, steps, last = [], [], 0.0
    for token in ids:
        now = time.perf_counter()
        if len(out) >= WARM_TOKENS:
            steps.append(now - last)
        out.append(token)
        last = now
    return out, steps


def batchgpu_decode(device: bg.Device, quantized: bool, tokens: int) -> tuple[list[int], list[float], int]:
    model = Llama(device, quantized=quantized, max_context=128)
    weight_bytes = sum(t.nbytes for t in model.params.values())
    ids, steps = steady_steps(model.generate(PROMPT, tokens))
    return ids, steps, weight_bytes


def copy_bandwidth() -> float:
    src = np.ones(64 * 2**20, np.float32)
    dst = np.empty_like(src)
    best = math.inf
    for _ in range(5):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return 2 * src.nbytes / best  # a copy moves every byte twice: read once, written once


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=10, help="greedy tokens (all but the first 3 timed)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    if args.tokens <= WARM_TOKENS:
        parser.error(f"--tokens must be more than {WARM_TOKENS}: the first {WARM_TOKENS} tokens are warm-up")
    device = bg.Device(args.device)
    bandwidth = copy_bandwidth()
    rows = []
    load_before = load_average()
    numpy_ids, numpy_steps = (decoder := NumpyDecoder(GGUFWeights(smollm2_path()))).generate(PROMPT, args.tokens)
    rows.append(("numpy fp32 (baseline)", numpy_ids, numpy_steps, decoder.weight_bytes(), load_average()))
    del decoder
    for quantized in (False, True):
        ids, steps, nbytes = batchgpu_decode(device, quantized, args.tokens)
        rows.append((f"batchgpu {'Q4_1/Q8_0' if quantized else 'fp32'}", ids, steps, nbytes, load_average()))

    timed = f"timed: tokens {WARM_TOKENS + 1}..{args.tokens}"
    print(f"SmolLM2-135M decode, {args.tokens} tokens after a {len(PROMPT)}-token prompt; {timed}")
    print(f"date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}; device: {device.name}")
    print(f"host memory bandwidth (numpy copy, read + write): {bandwidth / 1e9:.1f} GB/s")
    print(f"load average (1 min) before: {load_before:.2f} on {os.cpu_count()} CPUs\n")
    columns = "ms/token (median) | ms/token (mean) | tokens/s | weight MB/token | floor ms/token | x numpy | load"
    print(f"| decoder | {columns} |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    numpy_median = statistics.median(numpy_steps)
    results = []
    for name, ids, steps, nbytes, load in rows:
        median, mean = statistics.median(steps), statistics.fmean(steps)
        floor = nbytes / bandwidth
        print(
            f"| {name} | {median * 1e3:.1f} | {mean * 1e3:.1f} | {1 / median:.2f} | {nbytes / 1e6:.0f} | "
            f"{floor * 1e3:.1f} | {numpy_median / median:.2f} | {load:.2f} |"
        )
        results.append(
            {
                "decoder": name,
                "ids": ids,
                "ms_per_token_median": median * 1e3,
                "ms_per_token_mean": mean * 1e3,
                "steps_ms": [s * 1e3 for s in steps],
                "weight_bytes": nbytes,
                "floor_ms": floor * 1e3,
                "load_average": load,
            }
        )
    same = all(r[1] == rows[0][1] for r in rows)
    print(f"\nall decoders produced the same greedy ids: {same} ({rows[0][1]})")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": device.name, "bandwidth": bandwidth, "results": results}, handle, indent=2)


def decode_tokens_per_s(device: bg.Device, quick: bool = False) -> dict[str, float]:
    """Decode tokens/s (median step) for ``python -m batchgpu bench``: batchgpu with quantized weights
    (and fp32 and the numpy baseline unless ``quick``), after a 5-token prompt; 4 tokens when quick,
    else 10, the first WARM_TOKENS of each untimed."""
    tokens = WARM_TOKENS + 2 if quick else 10
    figures = {}
    if not quick:
        _, steps = NumpyDecoder(GGUFWeights(smollm2_path())).generate(PROMPT, tokens)
        figures["numpy fp32"] = 1 / statistics.median(steps)
    for quantized in (True,) if quick else (False, True):
        _, steps, _ = batchgpu_decode(device, quantized, tokens)
        figures[f"batchgpu {'Q4_1/Q8_0' if quantized else 'fp32'}"] = 1 / statistics.median(steps)
    return figures


if __name__ == "__main__":
    main()
