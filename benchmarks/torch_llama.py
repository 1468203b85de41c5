"""PyTorch decoders of SmolLM2-135M for benchmarks/native.py, from the same GGUF weights as batchgpu.

- :func:`hf_model`: ``transformers.LlamaForCausalLM`` built from a ``LlamaConfig`` matching the GGUF and
  loaded with the dequantized float32 weights (``GGUFWeights`` already undoes llama.cpp's Q/K row
  permutation, so the rows are in HF's rotate-half RoPE layout); decoded HF-style by :func:`hf_generate`
  (``model(..., past_key_values=...)`` per token, the default dynamic cache).
- :class:`StaticDecoder`: plain torch ops with a static KV cache and the position as a device tensor, so
  one decode step can be captured into a ``torch.cuda.CUDAGraph`` and replayed.

Both return greedy ids; the benchmark compares them with batchgpu's and prints MISMATCH when they differ.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
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
    """RoPE inverse frequencies, float32, as batchgpu's numpy decoder computes them."""
    cfg = weights.config
    d = cfg.head_dim
    return (1.0 / np.float32(cfg.theta) ** (np.arange(0, d, 2, dtype=np.float32) / d)).astype(np.float32)


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
    """Plain-torch Llama decode step on a static KV cache (graph-capturable: no host sync inside)."""

    def __init__(self, torch: Any, weights: GGUFWeights, device: str, max_context: int) -> None:
        self.torch = torch
        self.cfg = cfg = weights.config
        self.w = {
            name: torch.from_numpy(np.ascontiguousarray(weights.float32(name))).to(device) for name in weights.names()
        }
        shape = (cfg.layers, max_context, cfg.kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device)
        self.v = torch.zeros(shape, device=device)
        angles = np.arange(max_context, dtype=np.float32)[:, None] * inv_freq(weights)[None, :]
        self.cos = torch.from_numpy(np.cos(angles)).to(device)
        self.sin = torch.from_numpy(np.sin(angles)).to(device)
        self.positions = torch.arange(max_context, device=device)
        self.zeros = torch.zeros(max_context, device=device)
        self.minus_inf = torch.full((max_context,), float("-inf"), device=device)
        self.token = torch.zeros(1, dtype=torch.int64, device=device)
        self.pos = torch.zeros(1, dtype=torch.int64, device=device)
        self.out = torch.zeros(1, dtype=torch.int64, device=device)
        self.graph: Any = None

    def _rms(self, x: Any, g: Any) -> Any:
        return x * self.torch.rsqrt((x * x).mean(-1, keepdim=True) + self.cfg.eps) * g

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def step(self) -> Any:
        """One token (``self.token`` at ``self.pos``) through the model; returns the greedy next id (1,)."""
        torch, cfg, w = self.torch, self.cfg, self.w
        linear = torch.nn.functional.linear
        d, group = cfg.head_dim, cfg.heads // cfg.kv_heads
        cos, sin = self.cos.index_select(0, self.pos), self.sin.index_select(0, self.pos)  # (1, d/2)
        masked = torch.where(self.positions <= self.pos, self.zeros, self.minus_inf)  # (context,)
        context = self.positions.shape[0]
        h = w["token_embd.weight"].index_select(0, self.token)  # (1, hidden)
        for i in range(cfg.layers):
            b = f"blk.{i}."
            x = self._rms(h, w[b + "attn_norm.weight"])
            q = self._rope(linear(x, w[b + "attn_q.weight"]).view(cfg.heads, d), cos, sin)
            k = self._rope(linear(x, w[b + "attn_k.weight"]).view(cfg.kv_heads, d), cos, sin)
            v = linear(x, w[b + "attn_v.weight"]).view(cfg.kv_heads, d)
            self.k[i].index_copy_(0, self.pos, k.unsqueeze(0))
            self.v[i].index_copy_(0, self.pos, v.unsqueeze(0))
            # (context, heads, d): head j reads kv head j // group (HF's repeat_kv), no host sync
            keys = self.k[i].unsqueeze(2).expand(context, cfg.kv_heads, group, d).reshape(context, cfg.heads, d)
            values = self.v[i].unsqueeze(2).expand(context, cfg.kv_heads, group, d).reshape(context, cfg.heads, d)
            scores = torch.einsum("hd,chd->hc", q, keys) / math.sqrt(d) + masked
            att = torch.einsum("hc,chd->hd", torch.softmax(scores, -1), values).reshape(1, cfg.hidden)
            h = h + linear(att, w[b + "attn_output.weight"])
            x = self._rms(h, w[b + "ffn_norm.weight"])
            gate, up = linear(x, w[b + "ffn_gate.weight"]), linear(x, w[b + "ffn_up.weight"])
            h = h + linear(torch.nn.functional.silu(gate) * up, w[b + "ffn_down.weight"])
        logits = linear(self._rms(h, w["output_norm.weight"]), w["token_embd.weight"])
        return logits.argmax(-1)

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
