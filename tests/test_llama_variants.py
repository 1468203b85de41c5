"""Llama-family variants from tiny random GGUF files written here (no downloads): a Llama-layout model
(q/k rows permuted by the converter, tied output head, grouped-query attention) and a Qwen2 one (q/k/v
biases, an untied head, rows as they are). Prefill logits of the batchgpu model match a float64 numpy
model of the architecture written here (transformers' conventions: rotate-half RoPE) within
1e-5 x max|logit|, and greedy ids match, on the reference executor and lavapipe, with and without joined
projections."""

from __future__ import annotations

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.models.llama import Llama

gguf = pytest.importorskip("gguf", reason="the gguf package writes the test models")

DIMS = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=50, eps=1e-5, theta=10000.0)
PROMPT = [3, 17, 42, 8, 29]


def hf_weights(rng: np.random.Generator, *, biases: bool, tied: bool) -> dict[str, np.ndarray]:
    """Random float32 weights in transformers' layout, named as in GGUF."""
    d = DIMS
    hd = d["hidden"] // d["heads"]

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    w = {
        "token_embd.weight": matrix(d["vocab"], d["hidden"]) * 4,
        "output_norm.weight": 1 + 0.1 * rng.standard_normal(d["hidden"]).astype(np.float32),
    }
    for i in range(d["layers"]):
        b = f"blk.{i}."
        w[b + "attn_norm.weight"] = (1 + 0.1 * rng.standard_normal(d["hidden"])).astype(np.float32)
        w[b + "ffn_norm.weight"] = (1 + 0.1 * rng.standard_normal(d["hidden"])).astype(np.float32)
        w[b + "attn_q.weight"] = matrix(d["heads"] * hd, d["hidden"])
        w[b + "attn_k.weight"] = matrix(d["kv_heads"] * hd, d["hidden"])
        w[b + "attn_v.weight"] = matrix(d["kv_heads"] * hd, d["hidden"])
        w[b + "attn_output.weight"] = matrix(d["hidden"], d["heads"] * hd)
        w[b + "ffn_gate.weight"] = matrix(d["ffn"], d["hidden"])
        w[b + "ffn_up.weight"] = matrix(d["ffn"], d["hidden"])
        w[b + "ffn_down.weight"] = matrix(d["hidden"], d["ffn"])
        if biases:
            for name, rows in (("attn_q", d["heads"]), ("attn_k", d["kv_heads"]), ("attn_v", d["kv_heads"])):
                w[b + name + ".bias"] = (0.5 * rng.standard_normal(rows * hd)).astype(np.float32)
    if not tied:
        w["output.weight"] = matrix(d["vocab"], d["hidden"])
    return w


def permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row permutation (for interleaved RoPE)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_gguf(path, architecture: str, weights: dict[str, np.ndarray], **metadata: int) -> None:
    d = DIMS
    writer = gguf.GGUFWriter(str(path), architecture)
    for key, value in metadata.items():
        writer.add_uint32(f"{architecture}.{key.replace('__', '.')}", value)
    writer.add_block_count(d["layers"])
    writer.add_embedding_length(d["hidden"])
    writer.add_head_count(d["heads"])
    writer.add_head_count_kv(d["kv_heads"])
    writer.add_feed_forward_length(d["ffn"])
    writer.add_layer_norm_rms_eps(d["eps"])
    writer.add_rope_freq_base(d["theta"])
    writer.add_context_length(64)
    for name, array in weights.items():
        if architecture == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            array = permute(array, d["heads"])
        elif architecture == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            array = permute(array, d["kv_heads"])
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def float64_logits(weights: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """The architecture in float64 numpy: the last token's logits."""
    d = DIMS
    hd = d["hidden"] // d["heads"]
    f = {name: a.astype(np.float64) for name, a in weights.items()}

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + d["eps"]) * g

    def linear(x: np.ndarray, name: str) -> np.ndarray:
        return x @ f[name + ".weight"].T + f.get(name + ".bias", 0.0)

    def rope(x: np.ndarray) -> np.ndarray:
        inv = 1.0 / d["theta"] ** (np.arange(0, hd, 2) / hd)
        angle = np.arange(x.shape[0])[:, None] * inv[None, :]
        cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    t = len(ids)
    h = f["token_embd.weight"][ids]
    for i in range(d["layers"]):
        b = f"blk.{i}."
        x = rms(h, f[b + "attn_norm.weight"])
        q = rope(linear(x, b + "attn_q").reshape(t, d["heads"], hd))
        k = rope(linear(x, b + "attn_k").reshape(t, d["kv_heads"], hd))
        v = linear(x, b + "attn_v").reshape(t, d["kv_heads"], hd)
        group = d["heads"] // d["kv_heads"]
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
        scores += np.triu(np.full((t, t), -np.inf), 1)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        h = h + np.einsum("hts,shd->thd", p, v).reshape(t, -1) @ f[b + "attn_output.weight"].T
        x = rms(h, f[b + "ffn_norm.weight"])
        gate, up = x @ f[b + "ffn_gate.weight"].T, x @ f[b + "ffn_up.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ f[b + "ffn_down.weight"].T
    head = f.get("output.weight", f["token_embd.weight"])
    return rms(h, f["output_norm.weight"])[-1] @ head.T


VARIANTS = {"llama": dict(biases=False, tied=True), "qwen2": dict(biases=True, tied=False)}


@pytest.mark.parametrize("kind", ["reference", "wgpu"])
@pytest.mark.parametrize("architecture", sorted(VARIANTS))
def test_tiny_variant_matches_float64_numpy(tmp_path, architecture, kind):
    weights = hf_weights(np.random.default_rng(len(architecture)), **VARIANTS[architecture])
    path = tmp_path / f"{architecture}.gguf"
    write_gguf(path, architecture, weights)
    expected = float64_logits(weights, PROMPT)
    greedy, ids = [], list(PROMPT)
    for _ in range(4):
        token = int(np.argmax(float64_logits(weights, ids)))
        greedy.append(token)
        ids.append(token)
    device = bg.Device(kind)
    for fuse in (True, False):
        model = Llama(device, path, quantized=False, max_context=32, fuse=fuse)
        assert model.config.architecture == architecture
        step = model.prefill(PROMPT)
        logits = step.batch.read_sync(step.logits)[0]
        np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
        assert list(model.generate(PROMPT, 4)) == greedy


def test_unknown_architectures_are_refused(tmp_path):
    path = tmp_path / "gemma.gguf"
    write_gguf(path, "gemma", hf_weights(np.random.default_rng(0), biases=False, tied=True))
    with pytest.raises(bg.BatchError, match=r"GGUF architecture 'gemma' is not supported; supported: llama, qwen2"):
        Llama(bg.Device("reference"), path)


@pytest.mark.parametrize(
    ("extra", "metadata", "message"),
    [
        ({"rope_freqs.weight": np.ones(8, np.float32)}, {}, r"tensor 'rope_freqs.weight' is not used by this decoder"),
        ({"blk.0.attn_q_norm.weight": np.ones(16, np.float32)}, {}, r"tensor 'blk.0.attn_q_norm.weight' is not used"),
        (
            {},
            {"attention__sliding_window": 16},
            r"sliding-window attention \(Mistral\) \(llama.attention.sliding_window\)",
        ),
        ({}, {"attention__key_length": 32}, r"a head size other than hidden / heads"),
    ],
)
def test_features_the_decoder_lacks_are_refused(tmp_path, extra, metadata, message):
    """A file with tensors or settings the decoder would silently ignore (Llama 3 rope factors, Qwen3 q/k
    norms, Mistral's window) is refused by name instead of computing wrong numbers."""
    path = tmp_path / "model.gguf"
    write_gguf(path, "llama", {**hf_weights(np.random.default_rng(1), biases=False, tied=True), **extra}, **metadata)
    with pytest.raises(bg.BatchError, match=message):
        Llama(bg.Device("reference"), path)
    fine = tmp_path / "fine.gguf"  # the same model without them loads
    write_gguf(fine, "llama", hf_weights(np.random.default_rng(1), biases=False, tied=True), attention__key_length=16)
    Llama(bg.Device("reference"), fine)
