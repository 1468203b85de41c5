"""SmolLM2-135M decode speed: batchgpu (fp32 and quantized weights) beside a numpy fp32 decode of the
same model, measured in one run on one machine, with the bandwidth floor of each.

    python benchmarks/decode.py [--tokens 8] [--device wgpu] [--json out.json]

The floor is the weight bytes one token must read divided by the measured host memory bandwidth
(bytes read plus written per second by a numpy copy of a 256 MiB buffer): no decode that reads every
weight once can beat it.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from datetime import datetime, timezone

import numpy as np

import batchgpu as bg
from batchgpu.models.llama import GGUFWeights, Llama, smollm2_path

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

    def generate(self, prompt: list[int], tokens: int) -> tuple[list[int], float]:
        for pos, token in enumerate(prompt[:-1]):
            self.step(token, pos)
        token, pos, ids = prompt[-1], len(prompt) - 1, []
        started = None
        for _ in range(tokens):
            token = self.step(token, pos)
            pos += 1
            ids.append(token)
            if started is None:
                started = time.perf_counter()
        return ids, (time.perf_counter() - started) / max(tokens - 1, 1)


def batchgpu_decode(device: bg.Device, quantized: bool, tokens: int) -> tuple[list[int], float, int]:
    model = Llama(device, quantized=quantized, max_context=128)
    weight_bytes = sum(t.nbytes for t in model.params.values())
    ids, started = [], None
    for token in model.generate(PROMPT, tokens):
        ids.append(token)
        if started is None:
            started = time.perf_counter()  # decode time excludes prefill, recording and compiles
    return ids, (time.perf_counter() - started) / max(tokens - 1, 1), weight_bytes


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
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--device", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    device = bg.Device(args.device)
    bandwidth = copy_bandwidth()
    rows = []
    numpy_ids, numpy_s = (decoder := NumpyDecoder(GGUFWeights(smollm2_path()))).generate(PROMPT, args.tokens)
    rows.append(("numpy fp32 (baseline)", numpy_ids, numpy_s, decoder.weight_bytes()))
    del decoder
    for quantized in (False, True):
        ids, seconds, nbytes = batchgpu_decode(device, quantized, args.tokens)
        rows.append((f"batchgpu {'Q4_1/Q8_0' if quantized else 'fp32'}", ids, seconds, nbytes))

    print(f"SmolLM2-135M decode, {args.tokens} tokens after a {len(PROMPT)}-token prompt")
    print(f"date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}; device: {device.name}")
    print(f"host memory bandwidth (numpy copy, read + write): {bandwidth / 1e9:.1f} GB/s\n")
    print("| decoder | ms/token | tokens/s | weight MB/token | floor ms/token | x numpy |")
    print("|---|---:|---:|---:|---:|---:|")
    results = []
    for name, ids, seconds, nbytes in rows:
        floor = nbytes / bandwidth
        print(
            f"| {name} | {seconds * 1e3:.1f} | {1 / seconds:.2f} | {nbytes / 1e6:.0f} | {floor * 1e3:.1f} | "
            f"{numpy_s / seconds:.2f} |"
        )
        results.append(
            {
                "decoder": name,
                "ids": ids,
                "ms_per_token": seconds * 1e3,
                "weight_bytes": nbytes,
                "floor_ms": floor * 1e3,
            }
        )
    same = all(r[1] == rows[0][1] for r in rows)
    print(f"\nall decoders produced the same greedy ids: {same} ({rows[0][1]})")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": device.name, "bandwidth": bandwidth, "results": results}, handle, indent=2)


def decode_tokens_per_s(device: bg.Device, quick: bool = False) -> dict[str, float]:
    """Decode tokens/s for ``python -m batchgpu bench``: batchgpu with quantized weights (and fp32 and
    the numpy baseline unless ``quick``), after a 5-token prompt; 3 tokens when quick, else 8."""
    tokens = 3 if quick else 8
    figures = {}
    if not quick:
        _, seconds = NumpyDecoder(GGUFWeights(smollm2_path())).generate(PROMPT, tokens)
        figures["numpy fp32"] = 1 / seconds
    for quantized in (True,) if quick else (False, True):
        _, seconds, _ = batchgpu_decode(device, quantized, tokens)
        figures[f"batchgpu {'Q4_1/Q8_0' if quantized else 'fp32'}"] = 1 / seconds
    return figures


if __name__ == "__main__":
    main()
