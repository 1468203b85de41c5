"""PyTorch decoders of SmolLM2-135M for benchmarks/native.py, from the same GGUF weights as batchgpu.

- :func:`hf_model`: ``transformers.LlamaForCausalLM`` built from a ``LlamaConfig`` matching the GGUF and
  loaded with the dequantized float32 weights (``GGUFWeights`` already undoes llama.cpp's Q/K row
  permutation, so the rows are in HF's rotate-half RoPE layout); decoded HF-style by :func:`hf_generate`
  (``model(..., past_key_values=...)`` per token, the default dynamic cache).
- :class:`StaticDecoder`: plain torch ops with a static KV cache and the position as a device tensor, so
  one decode step can be captured into a ``torch.cuda.CUDAGraph`` and replayed; float32 or float16 (norms and
  softmax in float32, as transformers), q/k/v biases (Qwen2), an untied output head and RoPE factors
  (Llama 3) where the file has them; :meth:`StaticDecoder.prefill` runs a prompt as one causal forward.

Both return greedy ids; the benchmark compares them with batchgpu's and prints MISMATCH when they differ.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from batchgpu.models.llama import GGUFWeights

HF_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def inv_freq(weights: GGUFWeights) -> np.ndarray:
    """RoPE inverse frequencies, float32, as batchgpu's numpy decoder computes them (each divided by the
    config's RoPE factor of its pair where it has them: Llama 3)."""
    cfg = weights.config
    d = cfg.head_dim
    inv = 1.0 / np.float32(cfg.theta) ** (np.arange(0, d, 2, dtype=np.float32) / d)
    if cfg.rope_factors is not None:
        inv = inv / np.asarray(cfg.rope_factors, np.float32)
    return inv.astype(np.float32)


def device_weights(torch: Any, weights: GGUFWeights, device: str, dtype: Any) -> dict[str, Any]:
    """Every tensor dequantized on the host (one thread per CPU: numpy frees the GIL) and moved to ``device``
    as ``dtype``; at most one float32 copy per thread is on the host at a time."""

    def one(name: str) -> Any:
        return torch.from_numpy(np.ascontiguousarray(weights.float32(name))).to(device=device, dtype=dtype)

    names = weights.names()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(names, pool.map(one, names)))


def hf_state_dict(weights: GGUFWeights) -> dict[str, np.ndarray]:
    """GGUF tensor names -> HF Llama parameter names, float32 (the output head is tied to the embeddings)."""
    state = {}
    for name in weights.names():
        if name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            key = "model.norm.weight"
        elif name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            key = f"model.layers.{layer}.{HF_NAMES[rest]}"
        else:
            raise ValueError(f"GGUF tensor {name!r} has no HF Llama counterpart")
        state[key] = weights.float32(name)
    return state


def hf_model(torch: Any, weights: GGUFWeights, device: str, max_context: int) -> tuple[Any, list[str]]:
    """(LlamaForCausalLM in float32 on ``device``, notes about the load)."""
    import transformers

    cfg = weights.config
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.eps,
        rope_theta=cfg.theta,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.theta},  # transformers 5 spelling
        max_position_embeddings=max(max_context, 2048),
        tie_word_embeddings=True,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
    )
    model = transformers.LlamaForCausalLM(config).to(dtype=torch.float32)
    state = {key: torch.from_numpy(np.ascontiguousarray(value)) for key, value in hf_state_dict(weights).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    notes = []
    missing = [k for k in missing if k != "lm_head.weight" and not k.endswith("inv_freq")]
    if missing or unexpected:
        raise RuntimeError(f"HF Llama load: missing {missing[:5]}, unexpected {list(unexpected)[:5]}")
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2 and batchgpu's Llama
    model = model.to(device).eval()
    rotary = model.model.rotary_emb
    want = torch.from_numpy(inv_freq(weights)).to(device)
    if rotary.inv_freq.shape != want.shape or not torch.allclose(rotary.inv_freq.float(), want, rtol=1e-6):
        notes.append(f"HF rotary inv_freq did not match theta={cfg.theta}: set explicitly")
        rotary.inv_freq = want
        if hasattr(rotary, "original_inv_freq"):
            rotary.original_inv_freq = want
    return model, notes


def hf_generate(
    torch: Any, model: Any, prompt: Sequence[int], tokens: int, device: str
) -> tuple[list[int], list[float]]:
    """HF-style greedy decode: prompt forward, then one ``model()`` call per token with its KV cache.
    Returns (ids, seconds of each decode step); each step ends with the token on the host."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(prompt)], device=device), use_cache=True)
        past, token = out.past_key_values, int(out.logits[0, -1].argmax())
        ids, times = [token], []
        for _ in range(tokens - 1):
            started = time.perf_counter()
            out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=past, use_cache=True)
            past, token = out.past_key_values, int(out.logits[0, -1].argmax())
            times.append(time.perf_counter() - started)
            ids.append(token)
    return ids, times


class StaticDecoder:
    """Plain-torch Llama decode step on a static KV cache (graph-capturable: no host sync inside), its
    weights, activations and KV cache in ``dtype`` (default float32)."""

    def __init__(self, torch: Any, weights: GGUFWeights, device: str, max_context: int, dtype: Any = None) -> None:
        self.torch = torch
        self.cfg = cfg = weights.config
        self.dtype = dtype = dtype or torch.float32
        self.w = device_weights(torch, weights, device, dtype)
        self.head = self.w.get("output.weight", self.w["token_embd.weight"])  # tied where the file has no head
        shape = (cfg.layers, max_context, cfg.kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        angles = np.arange(max_context, dtype=np.float32)[:, None] * inv_freq(weights)[None, :]
        self.cos = torch.from_numpy(np.cos(angles)).to(device=device, dtype=dtype)
        self.sin = torch.from_numpy(np.sin(angles)).to(device=device, dtype=dtype)
        self.positions = torch.arange(max_context, device=device)
        self.zeros = torch.zeros(max_context, device=device, dtype=dtype)
        self.minus_inf = torch.full((max_context,), float("-inf"), device=device, dtype=dtype)
        self.token = torch.zeros(1, dtype=torch.int64, device=device)
        self.pos = torch.zeros(1, dtype=torch.int64, device=device)
        self.out = torch.zeros(1, dtype=torch.int64, device=device)
        self.graph: Any = None

    def _rms(self, x: Any, g: Any) -> Any:
        """RMS norm in float32, the result in the model's dtype times the weight (transformers' order)."""
        x32 = x.float()
        return (x32 * self.torch.rsqrt((x32 * x32).mean(-1, keepdim=True) + self.cfg.eps)).to(self.dtype) * g

    def _project(self, x: Any, name: str) -> Any:
        """``x @ W.T`` (+ the bias where the file has one: Qwen2's q/k/v)."""
        bias = self.w.get(name.removesuffix("weight") + "bias")
        return self.torch.nn.functional.linear(x, self.w[name], bias)

    def _attention(self, q: Any, keys: Any, values: Any, mask: Any) -> Any:
        """Softmax attention of q (tokens, heads, d) over the cache rows (context, kv heads, d) with an additive
        mask (tokens, context): head j reads kv head j // group (transformers' repeat_kv); softmax in float32."""
        cfg = self.cfg
        context, group = keys.shape[0], cfg.heads // cfg.kv_heads
        shape = (context, cfg.kv_heads, group, cfg.head_dim)
        keys = keys.unsqueeze(2).expand(shape).reshape(context, cfg.heads, cfg.head_dim)
        values = values.unsqueeze(2).expand(shape).reshape(context, cfg.heads, cfg.head_dim)
        scores = self.torch.einsum("thd,chd->thc", q, keys) / math.sqrt(cfg.head_dim) + mask[:, None, :]
        weights = self.torch.softmax(scores.float(), -1).to(self.dtype)
        return self.torch.einsum("thc,chd->thd", weights, values).reshape(q.shape[0], cfg.heads * cfg.head_dim)

    def _layers(self, h: Any, cos: Any, sin: Any, rows: Any, mask: Any) -> Any:
        """Every layer over the tokens ``h`` (tokens, hidden) at cache rows ``rows`` (their positions)."""
        cfg, w = self.cfg, self.w
        d, tokens = cfg.head_dim, h.shape[0]
        for i in range(cfg.layers):
            b = f"blk.{i}."
            x = self._rms(h, w[b + "attn_norm.weight"])
            q = self._rope(self._project(x, b + "attn_q.weight").view(tokens, cfg.heads, d), cos, sin)
            k = self._rope(self._project(x, b + "attn_k.weight").view(tokens, cfg.kv_heads, d), cos, sin)
            v = self._project(x, b + "attn_v.weight").view(tokens, cfg.kv_heads, d)
            self.k[i].index_copy_(0, rows, k)
            self.v[i].index_copy_(0, rows, v)
            h = h + self._project(self._attention(q, self.k[i], self.v[i], mask), b + "attn_output.weight")
            x = self._rms(h, w[b + "ffn_norm.weight"])
            gate, up = self._project(x, b + "ffn_gate.weight"), self._project(x, b + "ffn_up.weight")
            h = h + self._project(self.torch.nn.functional.silu(gate) * up, b + "ffn_down.weight")
        return h

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:
        """Rotate-half RoPE of x (tokens, heads, d) by the tokens' cos/sin rows (tokens, d/2)."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        cos, sin = cos[:, None, :], sin[:, None, :]
        return self.torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def step(self) -> Any:
        """One token (``self.token`` at ``self.pos``) through the model; returns the greedy next id (1,)."""
        cos, sin = self.cos.index_select(0, self.pos), self.sin.index_select(0, self.pos)  # (1, d/2)
        mask = self.torch.where(self.positions <= self.pos, self.zeros, self.minus_inf)[None, :]  # (1, context)
        h = self._layers(self.w["token_embd.weight"].index_select(0, self.token), cos, sin, self.pos, mask)
        logits = self.torch.nn.functional.linear(self._rms(h, self.w["output_norm.weight"]), self.head)
        return logits.argmax(-1)

    def prefill(self, prompt: Sequence[int]) -> int:
        """The prompt as one causal forward from position 0 (its KV rows written); the greedy next id."""
        torch = self.torch
        tokens = len(prompt)
        rows = self.positions[:tokens]
        ids = torch.tensor(list(prompt), dtype=torch.int64, device=rows.device)
        mask = torch.where(self.positions[None, :] <= rows[:, None], self.zeros, self.minus_inf)  # (tokens, context)
        h = self._layers(self.w["token_embd.weight"].index_select(0, ids), self.cos[:tokens], self.sin[:tokens],
                         rows, mask)  # fmt: skip
        last = self._rms(h[-1:], self.w["output_norm.weight"])
        return int(torch.nn.functional.linear(last, self.head).argmax(-1).item())

    def capture(self) -> None:
        """Warm up on a side stream, then capture one step into a CUDA graph (replayed by :meth:`run`)."""
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.out.copy_(self.step())
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.out.copy_(self.step())
        self.graph = graph  # only once captured: a failed capture leaves eager steps

    def run(self, token: int, pos: int) -> int:
        self.token.fill_(token)
        self.pos.fill_(pos)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.out.copy_(self.step())
        return int(self.out.item())

    def generate(self, prompt: Sequence[int], tokens: int) -> tuple[list[int], list[float]]:
        """Greedy ids (the prompt one token per step, untimed) and the seconds of each decode step."""
        token = 0
        for pos, prompt_token in enumerate(prompt):
            token = self.run(prompt_token, pos)
        ids, times = [token], []
        for pos in range(len(prompt), len(prompt) + tokens - 1):
            started = time.perf_counter()
            token = self.run(token, pos)
            times.append(time.perf_counter() - started)
            ids.append(token)
        return ids, times
