"""Hostile model files (issue 27): GGUF files, Hugging Face directories (config.json, safetensors shards and
their index, tokenizer files) written here from the tiny Llama of tests/test_llama_variants.py and then
corrupted, one class of bad input per case. Each is refused with a ModelFileError naming the file and the
field, before anything sized by the bad value is allocated; afterwards a good model of the same format
still loads and gives the float64 model's logits and greedy ids.

No case allocates much even where the check is missing: sizes that would be gigabytes are refused by the
loader first (the probe of what happened without the checks ran each case in a process with a capped
address space)."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.errors import ModelFileError
from batchgpu.models.llama import Llama

from .test_llama_variants import VARIANTS, check_model, hf_name, random_weights, write_gguf, write_hf

gguf = pytest.importorskip("gguf", reason="the gguf package writes the test models")
pytest.importorskip("safetensors", reason="the safetensors package writes the test checkpoints")

V = gguf.GGUFValueType
D = VARIANTS["llama"]
WEIGHTS = random_weights(D, 27)
TOKENS = [chr(ord("A") + i) if i < 26 else chr(ord("a") + i - 26) for i in range(D["vocab"])]
SHARD = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"


def load(path: Path) -> Llama:
    """What a server does with a model's files before its first token: the weights (config and tensors),
    the tokenizer and chat template, the decoder on the reference device."""
    model = Llama(bg.Device("reference"), path, max_context=32)
    model.weights.codec()
    return model


# GGUF files ------------------------------------------------------------------------------------------------


def gguf_fields() -> dict[str, tuple]:
    """The tiny Llama's metadata: key -> (value, type[, item type])."""
    return {
        "llama.block_count": (D["layers"], V.UINT32),
        "llama.embedding_length": (D["hidden"], V.UINT32),
        "llama.attention.head_count": (D["heads"], V.UINT32),
        "llama.attention.head_count_kv": (D["kv_heads"], V.UINT32),
        "llama.feed_forward_length": (D["ffn"], V.UINT32),
        "llama.context_length": (64, V.UINT32),
        "llama.attention.layer_norm_rms_epsilon": (D["eps"], V.FLOAT32),
        "llama.rope.freq_base": (D["theta"], V.FLOAT32),
        "tokenizer.ggml.model": ("gpt2", V.STRING),
        "tokenizer.ggml.tokens": (TOKENS, V.ARRAY, V.STRING),
        "tokenizer.ggml.token_type": ([1] * D["vocab"], V.ARRAY, V.INT32),
        "tokenizer.ggml.eos_token_id": (2, V.UINT32),
        "tokenizer.chat_template": ("{% for m in messages %}{{ m['content'] }}{% endfor %}", V.STRING),
    }


def write_model_gguf(path: Path, fields: dict | None = None, tensors: dict | None = None) -> Path:
    """The tiny Llama as a GGUF file (rows not permuted: these files are refused before that matters),
    ``fields`` and ``tensors`` ({name: float32 array or (bytes, GGML type)}) replacing or adding to its
    own; None leaves one out."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, spec in {**gguf_fields(), **(fields or {})}.items():
        if spec is not None:
            writer.add_key_value(key, *spec)
    for name, array in {**WEIGHTS, **(tensors or {})}.items():
        if isinstance(array, tuple):
            writer.add_tensor(name, array[0], raw_dtype=array[1])
        elif array is not None:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_model(tmp: Path, **changes: Any) -> Path:
    return write_model_gguf(tmp / "model.gguf", **changes)


def part_offset(path: Path, name: str, part: int) -> int:
    """Byte offset in a good GGUF file of part ``part`` of metadata key or tensor ``name`` (the gguf
    package's reader lists each field's parts: a tensor's are name length, name, n_dims, dims, type, offset;
    a key's are key length, key, value type, then the value's)."""
    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get(name) or next(t.field for t in reader.tensors if t.name == name)
    return int(field.parts[part].ctypes.data - reader.data.ctypes.data)


def patched(path: Path, name: str, part: int, fmt: str, value: Any, skip: int = 0, values: tuple = ()) -> Path:
    """``path`` with ``value`` (or ``values``) packed as ``fmt`` over part ``part`` of ``name`` (plus
    ``skip`` bytes)."""
    at = part_offset(path, name, part) + skip
    data = bytearray(path.read_bytes())
    data[at : at + struct.calcsize(fmt)] = struct.pack(fmt, *(values or (value,)))
    path.write_bytes(bytes(data))
    return path


def gguf_patch(name: str, part: int, fmt: str, value: Any, skip: int = 0, **changes: Any) -> Callable[[Path], Path]:
    return lambda tmp: patched(gguf_model(tmp, **changes), name, part, fmt, value, skip)


def cut(path: Path, at: int) -> Path:
    path.write_bytes(path.read_bytes()[:at])
    return path


def gguf_cut(where: Callable[[Path], int]) -> Callable[[Path], Path]:
    def build(tmp: Path) -> Path:
        path = gguf_model(tmp)
        return cut(path, where(path))

    return build


def renamed_gguf(tmp: Path, name: str, part: int, old: bytes, new: bytes) -> Path:
    """A good file with ``old`` replaced by ``new`` (same length) in part ``part`` of ``name``."""
    path = gguf_model(tmp, fields={"x.aa": (1, V.UINT32), "x.ab": (2, V.UINT32)})
    at = part_offset(path, name, part)
    data = bytearray(path.read_bytes())
    assert data[at : at + len(old)] == old
    data[at : at + len(new)] = new
    path.write_bytes(bytes(data))
    return path


def q8_rows(array: np.ndarray) -> tuple[np.ndarray, Any]:
    return gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0


TENSOR_PART = {"dims": 3, "type": 4, "offset": 5}
EMBD = "token_embd.weight"
BIG = 2**40

GGUF_CASES = [
    # (id, build, field the message names)
    ("not GGUF", lambda tmp: cut(gguf_model(tmp), 3), r"magic"),
    ("bad magic", lambda tmp: patched(gguf_model(tmp), "GGUF.version", 0, "<I", 0x12345678, -4), r"magic"),
    ("version 1", gguf_patch("GGUF.version", 0, "<I", 1), r"version"),
    ("truncated in the counts", lambda tmp: cut(gguf_model(tmp), 12), r"tensor_count"),
    (
        "truncated in an array",
        gguf_cut(lambda p: part_offset(p, "tokenizer.ggml.tokens", 20)),
        r"tokenizer\.ggml\.tokens",
    ),
    (
        "truncated in tensor infos",
        gguf_cut(lambda p: part_offset(p, "blk.1.ffn_up.weight", 3)),
        r"blk\.1\.ffn_up\.weight",
    ),
    ("truncated in tensor data", gguf_cut(lambda p: p.stat().st_size - 100), r"past the end|ends"),
    ("tensor_count 2**60", gguf_patch("GGUF.tensor_count", 0, "<Q", 2**60), r"tensor_count"),
    ("kv_count 2**60", gguf_patch("GGUF.kv_count", 0, "<Q", 2**60), r"kv_count"),
    ("key length 2**62", gguf_patch("llama.block_count", 0, "<Q", 2**62), r"key"),
    ("string length 2**62", gguf_patch("tokenizer.ggml.model", 3, "<Q", 2**62), r"tokenizer\.ggml\.model"),
    ("string array length 2**40", gguf_patch("tokenizer.ggml.tokens", 4, "<Q", BIG), r"tokenizer\.ggml\.tokens"),
    (
        "byte array length 2**40",  # the gguf package's reader loops here, allocating until memory runs out
        gguf_patch("x.bytes", 4, "<Q", BIG, fields={"x.bytes": ([1, 2, 3], V.ARRAY, V.UINT8)}),
        r"x\.bytes",
    ),
    ("array length 2**64 - 1", gguf_patch("tokenizer.ggml.token_type", 4, "<Q", 2**64 - 1), r"token_type"),
    ("unknown value type", gguf_patch("llama.block_count", 2, "<I", 13), r"llama\.block_count"),
    ("unknown array item type", gguf_patch("tokenizer.ggml.token_type", 3, "<I", 77), r"token_type"),
    ("nested arrays", lambda tmp: gguf_model(tmp, fields={"x.n": ([[1], [2]], V.ARRAY, V.ARRAY)}), r"x\.n"),
    ("duplicate key", lambda tmp: renamed_gguf(tmp, "x.ab", 1, b"x.ab", b"x.aa"), r"x\.aa"),
    ("key not UTF-8", lambda tmp: renamed_gguf(tmp, "x.ab", 1, b"x.ab", b"x.\xff\xfe"), r"key"),
    ("tensor name not UTF-8", lambda tmp: renamed_gguf(tmp, "output_norm.weight", 1, b"output", b"\xffutput"), r"name"),
    (
        "duplicate tensor name",
        lambda tmp: renamed_gguf(tmp, "blk.1.ffn_up.weight", 1, b"blk.1", b"blk.0"),
        r"blk\.0\.ffn_up\.weight",
    ),
    ("tensor n_dims 5", gguf_patch("output_norm.weight", 2, "<I", 5), r"output_norm\.weight"),
    ("tensor n_dims 0", gguf_patch("output_norm.weight", 2, "<I", 0), r"output_norm\.weight"),
    ("tensor dimension 2**40", gguf_patch(EMBD, TENSOR_PART["dims"], "<Q", BIG), r"token_embd\.weight"),
    ("tensor dimension 0", gguf_patch(EMBD, TENSOR_PART["dims"], "<Q", 0), r"token_embd\.weight"),
    (
        "tensor dimensions overflowing 64 bits",
        lambda tmp: patched(gguf_model(tmp), EMBD, TENSOR_PART["dims"], "<QQ", 2**40, values=(2**40, 2**40)),
        r"token_embd\.weight",
    ),
    ("unknown ggml type", gguf_patch(EMBD, TENSOR_PART["type"], "<I", 200), r"token_embd\.weight"),
    ("tensor offset past the end", gguf_patch(EMBD, TENSOR_PART["offset"], "<Q", 2**50), r"token_embd\.weight"),
    ("tensor offset misaligned", gguf_patch("output_norm.weight", TENSOR_PART["offset"], "<Q", 4), r"output_norm"),
    (
        "tensors overlapping",  # output_norm's offset set to token_embd's (offset 0, the first tensor)
        gguf_patch("output_norm.weight", TENSOR_PART["offset"], "<Q", 0),
        r"overlap",
    ),
    (
        "block rows not whole blocks",
        gguf_patch(EMBD, TENSOR_PART["dims"], "<Q", 48, tensors={EMBD: q8_rows(WEIGHTS[EMBD])}),
        r"token_embd\.weight",
    ),
    (
        "alignment not a power of two",
        lambda tmp: gguf_model(tmp, fields={"general.alignment": (48, V.UINT32)}),
        r"alignment",
    ),
    ("alignment a string", lambda tmp: gguf_model(tmp, fields={"general.alignment": ("32", V.STRING)}), r"alignment"),
    # metadata the config is read from
    (
        "architecture an int",
        lambda tmp: gguf_model(tmp, fields={"general.architecture": (5, V.UINT32)}),
        r"architecture",
    ),
    (
        "block_count a string",
        lambda tmp: gguf_model(tmp, fields={"llama.block_count": ("2", V.STRING)}),
        r"block_count",
    ),
    (
        "block_count a float",
        lambda tmp: gguf_model(tmp, fields={"llama.block_count": (2.0, V.FLOAT32)}),
        r"block_count",
    ),
    ("block_count a bool", lambda tmp: gguf_model(tmp, fields={"llama.block_count": (True, V.BOOL)}), r"block_count"),
    (
        "block_count an array",
        lambda tmp: gguf_model(tmp, fields={"llama.block_count": ([2], V.ARRAY, V.UINT32)}),
        r"block_count",
    ),
    ("block_count missing", lambda tmp: gguf_model(tmp, fields={"llama.block_count": None}), r"block_count"),
    ("block_count 10**6", lambda tmp: gguf_model(tmp, fields={"llama.block_count": (10**6, V.UINT32)}), r"block_count"),
    (
        "block_count 3 (tensors of 2)",
        lambda tmp: gguf_model(tmp, fields={"llama.block_count": (3, V.UINT32)}),
        r"blk\.2\.",
    ),
    ("head_count 0", lambda tmp: gguf_model(tmp, fields={"llama.attention.head_count": (0, V.UINT32)}), r"head_count"),
    (
        "head_count_kv not dividing head_count",
        lambda tmp: gguf_model(tmp, fields={"llama.attention.head_count_kv": (3, V.UINT32)}),
        r"head_count_kv",
    ),
    (
        "embedding_length 10**9",
        lambda tmp: gguf_model(tmp, fields={"llama.embedding_length": (10**9, V.UINT32)}),
        r"embedding_length",
    ),
    (
        "embedding_length not a multiple of head_count",
        lambda tmp: gguf_model(tmp, fields={"llama.embedding_length": (66, V.UINT32)}),
        r"embedding_length",
    ),
    (
        "key_length 10**8",
        lambda tmp: gguf_model(tmp, fields={"llama.attention.key_length": (10**8, V.UINT32)}),
        r"key_length",
    ),
    (
        "key_length odd",
        lambda tmp: gguf_model(tmp, fields={"llama.attention.key_length": (15, V.UINT32)}),
        r"key_length",
    ),
    (
        "feed_forward_length 0",
        lambda tmp: gguf_model(tmp, fields={"llama.feed_forward_length": (0, V.UINT32)}),
        r"feed_forward_length",
    ),
    ("vocab_size 10**9", lambda tmp: gguf_model(tmp, fields={"llama.vocab_size": (10**9, V.UINT32)}), r"vocab_size"),
    (
        "context_length negative",
        lambda tmp: gguf_model(tmp, fields={"llama.context_length": (-5, V.INT32)}),
        r"context_length",
    ),
    (
        "rms epsilon NaN",
        lambda tmp: gguf_model(tmp, fields={"llama.attention.layer_norm_rms_epsilon": (float("nan"), V.FLOAT32)}),
        r"layer_norm_rms_epsilon",
    ),
    (
        "rms epsilon negative",
        lambda tmp: gguf_model(tmp, fields={"llama.attention.layer_norm_rms_epsilon": (-1e-5, V.FLOAT32)}),
        r"layer_norm_rms_epsilon",
    ),
    ("rope freq_base 0", lambda tmp: gguf_model(tmp, fields={"llama.rope.freq_base": (0.0, V.FLOAT32)}), r"freq_base"),
    (
        "linear RoPE factor 0",
        lambda tmp: gguf_model(
            tmp, fields={"llama.rope.scaling.type": ("linear", V.STRING), "llama.rope.scaling.factor": (0.0, V.FLOAT32)}
        ),
        r"rope\.scaling\.factor",
    ),
    (
        "rope_freqs of the wrong length",
        lambda tmp: gguf_model(tmp, tensors={"rope_freqs.weight": np.ones(5, np.float32)}),
        r"rope_freqs\.weight",
    ),
    (
        "rope_freqs quantized",
        lambda tmp: gguf_model(tmp, tensors={"rope_freqs.weight": q8_rows(np.ones((1, 32), np.float32))}),
        r"rope_freqs\.weight",
    ),
    # tensors against the config
    (
        "token_embd smaller than vocab x hidden",
        lambda tmp: gguf_model(tmp, fields={"llama.vocab_size": (50, V.UINT32)}, tensors={EMBD: WEIGHTS[EMBD][:40]}),
        r"token_embd\.weight",
    ),
    (
        "attn_q of the wrong shape",
        lambda tmp: gguf_model(tmp, tensors={"blk.0.attn_q.weight": WEIGHTS["blk.0.attn_q.weight"][:48]}),
        r"blk\.0\.attn_q\.weight",
    ),
    (
        "a tensor missing",
        lambda tmp: gguf_model(tmp, tensors={"blk.1.ffn_down.weight": None}),
        r"blk\.1\.ffn_down\.weight",
    ),
    (
        "a layer past block_count",
        lambda tmp: gguf_model(tmp, tensors={"blk.2.attn_norm.weight": WEIGHTS["blk.0.attn_norm.weight"]}),
        r"blk\.2\.attn_norm\.weight",
    ),
    (
        "q norm without k norm",
        lambda tmp: gguf_model(tmp, tensors={"blk.0.attn_q_norm.weight": np.ones(16, np.float32)}),
        r"blk\.0\.attn_k_norm\.weight",
    ),
    (
        "a 1-D tensor in a block format",
        lambda tmp: gguf_model(tmp, tensors={"output_norm.weight": q8_rows(WEIGHTS["output_norm.weight"])}),
        r"output_norm\.weight",
    ),
    (
        "a 3-D tensor",
        lambda tmp: gguf_model(tmp, tensors={"output_norm.weight": np.ones((2, 2, 16), np.float32)}),
        r"output_norm\.weight",
    ),
    # the tokenizer
    (
        "tokens not strings",
        lambda tmp: gguf_model(tmp, fields={"tokenizer.ggml.tokens": (list(range(50)), V.ARRAY, V.INT32)}),
        r"tokenizer\.ggml\.tokens",
    ),
    (
        "more tokens than embedding rows",
        lambda tmp: gguf_model(
            tmp,
            fields={
                "tokenizer.ggml.tokens": ([*TOKENS, *"0123456789"], V.ARRAY, V.STRING),
                "tokenizer.ggml.token_type": ([1] * 60, V.ARRAY, V.INT32),
            },
        ),
        r"tokenizer\.ggml\.tokens",
    ),
    (
        "bos id out of range",
        lambda tmp: gguf_model(tmp, fields={"tokenizer.ggml.bos_token_id": (500, V.UINT32)}),
        r"bos_token_id",
    ),
    (
        "token_type longer than tokens",
        lambda tmp: gguf_model(tmp, fields={"tokenizer.ggml.token_type": ([3] * 60, V.ARRAY, V.INT32)}),
        r"token_type",
    ),
    (
        "a merge without a space",
        lambda tmp: gguf_model(tmp, fields={"tokenizer.ggml.merges": (["AB"], V.ARRAY, V.STRING)}),
        r"merges",
    ),
    (
        "a merge of unknown tokens",
        lambda tmp: gguf_model(tmp, fields={"tokenizer.ggml.merges": (["@ #"], V.ARRAY, V.STRING)}),
        r"merges",
    ),
    (
        "tokenizer model an int",
        lambda tmp: gguf_model(tmp, fields={"tokenizer.ggml.model": (2, V.UINT32)}),
        r"tokenizer\.ggml\.model",
    ),
    (
        "chat template an array",
        lambda tmp: gguf_model(tmp, fields={"tokenizer.chat_template": (["x"], V.ARRAY, V.STRING)}),
        r"chat_template",
    ),
    (
        "token text not UTF-8",
        lambda tmp: renamed_gguf(tmp, "tokenizer.ggml.tokens", 6, b"A", b"\xff"),
        r"tokenizer\.ggml\.tokens",
    ),
]


# Hugging Face directories -------------------------------------------------------------------------------


def hf_model(tmp: Path, shards: int = 1, weights: dict | None = None) -> Path:
    directory = tmp / "model"
    write_hf(directory, "llama", weights or WEIGHTS, np.float32, shards)
    return directory


def read_safetensors(file: Path) -> tuple[dict, bytes]:
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write_safetensors(file: Path, header: dict | bytes, data: bytes, length: int | None = None) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def header_edit(change: Callable[[dict], Any]) -> Callable[[Path], Path]:
    """A one-file checkpoint whose safetensors header ``change`` edits in place (or returns anew: a dict
    or raw bytes)."""

    def build(tmp: Path) -> Path:
        directory = hf_model(tmp)
        file = directory / "model.safetensors"
        header, data = read_safetensors(file)
        result = change(header)
        write_safetensors(file, header if result is None else result, data)
        return directory

    return build


def raw_header(change: Callable[[bytes, bytes], bytes]) -> Callable[[Path], Path]:
    """A one-file checkpoint whose safetensors file becomes ``change(file bytes, data section)``."""

    def build(tmp: Path) -> Path:
        directory = hf_model(tmp)
        file = directory / "model.safetensors"
        _, data = read_safetensors(file)
        file.write_bytes(change(file.read_bytes(), data))
        return directory

    return build


Q = hf_name("blk.0.attn_q.weight")
NORM, FFN_NORM = hf_name("blk.0.attn_norm.weight"), hf_name("blk.0.ffn_norm.weight")


def entry(header: dict, name: str, **values: Any) -> None:
    header[name].update(values)


def shifted(header: dict, name: str, by: int) -> None:
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + by, end + by]


SAFETENSORS_CASES = [
    ("file of 5 bytes", raw_header(lambda raw, data: raw[:5]), r"header length"),
    ("header length 2**62", raw_header(lambda raw, data: struct.pack("<Q", 2**62) + raw[8:]), r"header length"),
    (
        "header length past the end",
        raw_header(lambda raw, data: struct.pack("<Q", len(raw)) + raw[8:]),
        r"header length",
    ),
    ("header not JSON", header_edit(lambda h: b'{"a": '), r"header"),
    ("header not UTF-8", header_edit(lambda h: b'{"\xff": 1}'), r"header"),
    ("header a JSON list", header_edit(lambda h: b"[1, 2]"), r"header"),
    ("header nested 10**5 deep", header_edit(lambda h: b"[" * 100_000 + b"]" * 100_000), r"header"),
    (
        "duplicate tensor name in a header",
        header_edit(lambda h: json.dumps(h)[:-1].encode() + b", " + json.dumps({Q: h[Q]})[1:].encode()),
        r"model\.layers\.0\.self_attn\.q_proj\.weight",
    ),
    ("entry not an object", header_edit(lambda h: h.update({Q: [1, 2]})), r"q_proj"),
    ("dtype missing", header_edit(lambda h: h[Q].pop("dtype") and None), r"dtype"),
    ("dtype unknown", header_edit(lambda h: entry(h, Q, dtype="F99")), r"dtype"),
    ("dtype a number", header_edit(lambda h: entry(h, Q, dtype=5)), r"dtype"),
    ("shape negative", header_edit(lambda h: entry(h, Q, shape=[-64, -64])), r"shape"),
    ("shape not ints", header_edit(lambda h: entry(h, Q, shape=[64.0, "64"])), r"shape"),
    ("shape of bools", header_edit(lambda h: entry(h, NORM, shape=[True])), r"shape"),
    ("shape 2**40", header_edit(lambda h: entry(h, Q, shape=[2**40, 2**40])), r"shape|data_offsets"),
    ("shape a string", header_edit(lambda h: entry(h, Q, shape="64")), r"shape"),
    ("data_offsets of one number", header_edit(lambda h: entry(h, Q, data_offsets=[0])), r"data_offsets"),
    ("data_offsets begin after end", header_edit(lambda h: entry(h, Q, data_offsets=[64, 0])), r"data_offsets"),
    (
        "data range shorter than shape x dtype",
        header_edit(lambda h: entry(h, Q, data_offsets=[h[Q]["data_offsets"][0], h[Q]["data_offsets"][1] - 4])),
        r"data_offsets",
    ),
    ("data range past the end", header_edit(lambda h: shifted(h, Q, 10**6)), r"data_offsets"),
    (
        "data ranges overlapping",
        header_edit(lambda h: entry(h, FFN_NORM, data_offsets=h[NORM]["data_offsets"])),
        r"overlap",
    ),
    (
        "data_offsets NaN",
        header_edit(lambda h: json.dumps(h).replace('"data_offsets": [0,', '"data_offsets": [NaN,').encode()),
        r"NaN",
    ),
    ("__metadata__ a list", header_edit(lambda h: h.update({"__metadata__": [1]})), r"__metadata__"),
]


def index_edit(change: Callable[[dict, Path], Any]) -> Callable[[Path], Path]:
    """A two-shard checkpoint whose index ``change`` edits (in place, or returns anew: any JSON value or
    raw bytes); ``change`` gets the directory too."""

    def build(tmp: Path) -> Path:
        directory = hf_model(tmp, shards=2)
        file = directory / INDEX
        index = json.loads(file.read_text())
        result = change(index, directory)
        result = index if result is None else result
        file.write_bytes(result if isinstance(result, bytes) else json.dumps(result).encode())
        return directory

    return build


def moved_out(index: dict, directory: Path, name: Callable[[Path], str]) -> None:
    """The second shard moved out of the directory and the index pointing at it by ``name(new place)``."""
    outside = directory.parent / "outside.safetensors"
    shutil.move(directory / SHARD[1], outside)
    for tensor, shard in index["weight_map"].items():
        if shard == SHARD[1]:
            index["weight_map"][tensor] = name(outside)


def symlinked_out(tmp: Path) -> Path:
    """The second shard outside the directory, a link in the directory in its place."""
    directory = hf_model(tmp, shards=2)
    outside = tmp / "outside.safetensors"
    shutil.move(directory / SHARD[1], outside)
    os.symlink(outside, directory / SHARD[1])
    return directory


def duplicated_across_shards(tmp: Path) -> Path:
    """No index; the second shard also holds a tensor of the first."""
    from safetensors.numpy import load_file, save_file

    directory = hf_model(tmp, shards=2)
    (directory / INDEX).unlink()
    first, second = (load_file(str(directory / shard)) for shard in SHARD)
    name = next(iter(first))
    save_file({**second, name: first[name]}, str(directory / SHARD[1]))
    return directory


INDEX_CASES = [
    ("index names ../x", index_edit(lambda i, d: moved_out(i, d, lambda p: "../" + p.name)), r"weight_map"),
    ("index names an absolute path", index_edit(lambda i, d: moved_out(i, d, str)), r"weight_map"),
    (
        "index names a subfolder",
        index_edit(lambda i, d: i["weight_map"].update({Q: "sub/x.safetensors"})),
        r"weight_map",
    ),
    ("index names .", index_edit(lambda i, d: i["weight_map"].update({Q: "."})), r"weight_map"),
    ("index names an empty string", index_edit(lambda i, d: i["weight_map"].update({Q: ""})), r"weight_map"),
    ("index names a NUL byte", index_edit(lambda i, d: i["weight_map"].update({Q: "x\0y"})), r"weight_map"),
    ("shard a symlink out of the directory", symlinked_out, r"outside|resolves"),
    ("index not JSON", index_edit(lambda i, d: b"{weight_map"), r"JSON"),
    ("index a list", index_edit(lambda i, d: [1]), r"object"),
    ("index without weight_map", index_edit(lambda i, d: {}), r"weight_map"),
    ("weight_map a list", index_edit(lambda i, d: {"weight_map": [SHARD[0]]}), r"weight_map"),
    ("weight_map value an int", index_edit(lambda i, d: i["weight_map"].update({Q: 5})), r"weight_map"),
    (
        "index names a tensor its shard lacks",
        index_edit(lambda i, d: i["weight_map"].update({"model.layers.0.extra.weight": SHARD[0]})),
        r"model\.layers\.0\.extra\.weight",
    ),
    (
        "index leaves out a tensor",
        index_edit(lambda i, d: i["weight_map"].pop(Q) and None),
        r"q_proj",
    ),
    (
        "index maps a tensor to the other shard",
        index_edit(lambda i, d: i["weight_map"].update({Q: SHARD[1] if i["weight_map"][Q] == SHARD[0] else SHARD[0]})),
        r"q_proj",
    ),
    ("a tensor in two shards", duplicated_across_shards, r"in both|twice|two"),
]


def config_edit(change: Callable[[dict], Any], shards: int = 1) -> Callable[[Path], Path]:
    """A checkpoint whose config.json ``change`` edits in place (or returns anew: any JSON value or raw bytes)."""

    def build(tmp: Path) -> Path:
        directory = hf_model(tmp, shards)
        file = directory / "config.json"
        config = json.loads(file.read_text())
        result = change(config)
        result = config if result is None else result
        file.write_bytes(result if isinstance(result, bytes) else json.dumps(result).encode())
        return directory

    return build


def setting(**values: Any) -> Callable[[Path], Path]:
    return config_edit(lambda c: c.update(values))


LLAMA3 = dict(rope_type="llama3", factor=8.0, original_max_position_embeddings=16)

CONFIG_CASES = [
    ("config not JSON", config_edit(lambda c: b"{hidden_size: 64}"), r"JSON"),
    ("config a list", config_edit(lambda c: [c]), r"object"),
    ("config nested 10**5 deep", config_edit(lambda c: b"[" * 100_000 + b"]" * 100_000), r"JSON|object"),
    (
        "config with a duplicate key",
        config_edit(lambda c: json.dumps(c)[:-1].encode() + b', "hidden_size": 128}'),
        r"hidden_size",
    ),
    ("hidden_size missing", config_edit(lambda c: c.pop("hidden_size") and None), r"hidden_size"),
    ("hidden_size 10**9", setting(hidden_size=10**9), r"hidden_size"),
    ("hidden_size a string", setting(hidden_size="64"), r"hidden_size"),
    ("hidden_size a float", setting(hidden_size=64.0), r"hidden_size"),
    ("hidden_size a bool", setting(hidden_size=True), r"hidden_size"),
    (
        "hidden_size not a multiple of the heads",
        config_edit(lambda c: c.update(hidden_size=66, head_dim=None)),
        r"hidden_size",
    ),
    ("head_dim 10**8", setting(head_dim=10**8), r"head_dim"),
    ("head_dim odd", setting(head_dim=15), r"head_dim"),
    ("num_hidden_layers 10**7", setting(num_hidden_layers=10**7), r"num_hidden_layers"),
    ("num_attention_heads 0", setting(num_attention_heads=0), r"num_attention_heads"),
    ("num_key_value_heads not dividing the heads", setting(num_key_value_heads=3), r"num_key_value_heads"),
    ("vocab_size -5", setting(vocab_size=-5), r"vocab_size"),
    ("intermediate_size 0", setting(intermediate_size=0), r"intermediate_size"),
    ("max_position_embeddings negative", setting(max_position_embeddings=-1), r"max_position_embeddings"),
    ("sliding_window negative", setting(sliding_window=-3), r"sliding_window"),
    ("rms_norm_eps not a number", setting(rms_norm_eps="abc"), r"rms_norm_eps"),
    ("rms_norm_eps a numeric string", setting(rms_norm_eps="1e-5"), r"rms_norm_eps"),
    (
        "rms_norm_eps NaN",
        config_edit(lambda c: json.dumps(c).replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": NaN').encode()),
        r"NaN",
    ),
    ("rms_norm_eps 0", setting(rms_norm_eps=0), r"rms_norm_eps"),
    ("rope_theta negative", setting(rope_theta=-1.0), r"rope_theta"),
    ("rope_scaling a list", setting(rope_scaling=[1]), r"rope_scaling"),
    (
        "llama3 RoPE high == low",
        setting(rope_scaling=dict(LLAMA3, low_freq_factor=1.0, high_freq_factor=1.0)),
        r"high_freq_factor",
    ),
    ("llama3 RoPE factor missing", setting(rope_scaling=dict(LLAMA3, low_freq_factor=1.0)), r"high_freq_factor"),
    ("linear RoPE factor 0", setting(rope_scaling={"rope_type": "linear", "factor": 0}), r"factor"),
    ("model_type a list", setting(model_type=["llama"]), r"model_type"),
    ("tie_word_embeddings a string", setting(tie_word_embeddings="yes"), r"tie_word_embeddings"),
    ("hidden_act a list", setting(hidden_act=["silu"]), r"hidden_act"),
    # the config against the tensors
    ("vocab_size larger than the embedding", setting(vocab_size=60), r"embed_tokens"),
    ("intermediate_size other than the tensors'", setting(intermediate_size=100), r"gate_proj|up_proj|down_proj"),
    ("num_hidden_layers 3 (tensors of 2)", setting(num_hidden_layers=3), r"layers\.2|blk\.2"),
    ("num_hidden_layers 1 (tensors of 2)", setting(num_hidden_layers=1), r"layers\.1"),
    (
        "embedding smaller than vocab x hidden",
        lambda tmp: hf_model(tmp, weights={**WEIGHTS, EMBD: WEIGHTS[EMBD][:40]}),
        r"embed_tokens",
    ),
    (
        "a tensor missing",
        lambda tmp: hf_model(tmp, weights={k: v for k, v in WEIGHTS.items() if k != "blk.1.ffn_down.weight"}),
        r"ffn_down|down_proj",
    ),
]


def outside_file(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def linked_out(name: str, text: Callable[[Path], str]) -> Callable[[Path], Path]:
    """A checkpoint whose ``name`` is a link to a file outside the directory."""

    def build(tmp: Path) -> Path:
        directory = hf_model(tmp)
        content = text(directory)
        (directory / name).unlink(missing_ok=True)
        os.symlink(outside_file(tmp, "secret", content), directory / name)
        return directory

    return build


def tokenizer_edit(name: str, content: Callable[[Path], Any]) -> Callable[[Path], Path]:
    """A checkpoint with ``name`` written as ``content(directory)`` (a JSON value, or raw bytes)."""

    def build(tmp: Path) -> Path:
        directory = hf_model(tmp)
        value = content(directory)
        (directory / name).write_bytes(value if isinstance(value, bytes) else json.dumps(value).encode())
        return directory

    return build


def bigger_tokenizer(directory: Path) -> bytes:
    from tokenizers import Tokenizer, models

    vocab = {token: i for i, token in enumerate([*TOKENS, *"0123456789"])}
    Tokenizer(models.BPE(vocab, [])).save(str(directory / "tokenizer.json"))
    return (directory / "tokenizer.json").read_bytes()


CODEC_CASES = [
    (
        "tokenizer.json a link out of the directory",
        linked_out("tokenizer.json", lambda d: (d / "tokenizer.json").read_text()),
        r"tokenizer\.json",
    ),
    (
        "chat_template.jinja a link out of the directory",
        linked_out("chat_template.jinja", lambda d: "secret text"),
        r"chat_template\.jinja",
    ),
    (
        "config.json a link out of the directory",
        linked_out("config.json", lambda d: (d / "config.json").read_text()),
        r"config\.json",
    ),
    ("tokenizer.json not a tokenizer", tokenizer_edit("tokenizer.json", lambda d: b"{not json"), r"tokenizer\.json"),
    (
        "tokenizer_config.json not JSON",
        tokenizer_edit("tokenizer_config.json", lambda d: b"{"),
        r"tokenizer_config\.json",
    ),
    ("tokenizer_config.json a list", tokenizer_edit("tokenizer_config.json", lambda d: [1]), r"tokenizer_config\.json"),
    ("chat_template an int", tokenizer_edit("tokenizer_config.json", lambda d: {"chat_template": 5}), r"chat_template"),
    (
        "chat_template list of non-objects",
        tokenizer_edit("tokenizer_config.json", lambda d: {"chat_template": [5]}),
        r"chat_template",
    ),
    ("eos_token a list", tokenizer_edit("tokenizer_config.json", lambda d: {"eos_token": ["x"]}), r"eos_token"),
    (
        "generation_config.json not JSON",
        tokenizer_edit("generation_config.json", lambda d: b"{x"),
        r"generation_config\.json",
    ),
    (
        "eos_token_id a string",
        tokenizer_edit("generation_config.json", lambda d: {"eos_token_id": "abc"}),
        r"eos_token_id",
    ),
    (
        "eos_token_id past the vocabulary",
        tokenizer_edit("generation_config.json", lambda d: {"eos_token_id": [2, 10**12]}),
        r"eos_token_id",
    ),
    (
        "chat_template.jinja not UTF-8",
        tokenizer_edit("chat_template.jinja", lambda d: b"\xff\xfe{{"),
        r"chat_template\.jinja",
    ),
    ("tokenizer larger than the vocabulary", tokenizer_edit("tokenizer.json", bigger_tokenizer), r"tokenizer\.json"),
]


@dataclass(frozen=True)
class Hostile:
    """One class of bad input: how to write it, the file the message must name, the field it must name."""

    build: Callable[[Path], Path]
    file: str
    field: str


def hostile(group: str, cases: list, file: str, files: dict[str, str] | None = None) -> dict[str, Hostile]:
    """The cases of one group by id, naming ``file`` (or the case's own of ``files``)."""
    files = files or {}
    return {f"{group}: {name}": Hostile(build, files.get(name, file), field) for name, build, field in cases}


CASES = {
    **hostile("gguf", GGUF_CASES, "model.gguf"),
    **hostile("safetensors", SAFETENSORS_CASES, "model.safetensors"),
    **hostile("index", INDEX_CASES, INDEX, {"a tensor in two shards": SHARD[0]}),
    **hostile("config", CONFIG_CASES[:-6], "config.json"),
    **hostile("tensors", CONFIG_CASES[-6:], "model"),
    **hostile(
        "codec",
        CODEC_CASES,
        "tokenizer.json",
        {
            "chat_template.jinja a link out of the directory": "chat_template.jinja",
            "config.json a link out of the directory": "config.json",
            "tokenizer_config.json not JSON": "tokenizer_config.json",
            "tokenizer_config.json a list": "tokenizer_config.json",
            "chat_template an int": "tokenizer_config.json",
            "chat_template list of non-objects": "tokenizer_config.json",
            "eos_token a list": "tokenizer_config.json",
            "generation_config.json not JSON": "generation_config.json",
            "eos_token_id a string": "generation_config.json",
            "eos_token_id past the vocabulary": "generation_config.json",
            "chat_template.jinja not UTF-8": "chat_template.jinja",
        },
    ),
}


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """A good model of each format and the weights it holds."""
    tmp = tmp_path_factory.mktemp("good")
    gguf_weights = write_gguf(tmp / "good.gguf", "llama", WEIGHTS)
    hf_weights = write_hf(tmp / "good", "llama", WEIGHTS, np.float32, 2)
    return {"gguf": (tmp / "good.gguf", gguf_weights), "hf": (tmp / "good", hf_weights)}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_file_is_refused_by_name(tmp_path, good, case):
    hostile_case = CASES[case]
    path = hostile_case.build(tmp_path)
    tracemalloc.start()
    try:
        with pytest.raises(ModelFileError) as refused:
            load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak} bytes allocated before the refusal"  # the good model's files: ~0.3 MB
    message = str(refused.value)
    assert hostile_case.file in message, message
    assert re.search(hostile_case.field, message), message
    good_path, weights = good["gguf" if path.suffix == ".gguf" else "hf"]
    check_model(load(good_path), D, weights)


# what must still load ------------------------------------------------------------------------------------


def test_links_inside_the_directory_are_followed(tmp_path):
    """A shard (or tokenizer.json) that links to a file elsewhere inside the model directory is read."""
    directory = hf_model(tmp_path, shards=2)
    (directory / "real").mkdir()
    for name in (SHARD[1], "tokenizer.json"):
        shutil.move(directory / name, directory / "real" / name)
        os.symlink(Path("real") / name, directory / name)
    check_model(load(directory), D, WEIGHTS)


def test_a_hugging_face_cache_snapshot_loads(tmp_path):
    """The layout of a Hugging Face cache: ``<repo>/snapshots/<revision>/<name>`` links to
    ``<repo>/blobs/<hash>``. Those links are followed; one to anywhere else is refused."""
    source = hf_model(tmp_path)
    repo = tmp_path / "models--tiny--llama"
    snapshot, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, file in enumerate(sorted(source.iterdir())):
        shutil.move(file, blobs / f"blob{i}")
        os.symlink(Path("..") / ".." / "blobs" / f"blob{i}", snapshot / file.name)
    check_model(load(snapshot), D, WEIGHTS)
    (snapshot / "chat_template.jinja").symlink_to(outside_file(tmp_path, "secret", "secret text"))
    with pytest.raises(ModelFileError, match=r"file 'chat_template.jinja' resolves to .*secret, outside the model"):
        load(snapshot)


def every_value_type() -> dict[str, tuple]:
    """Metadata of every GGUF value type, scalars and arrays."""
    scalars = {
        V.UINT8: 200,
        V.INT8: -100,
        V.UINT16: 60000,
        V.INT16: -30000,
        V.UINT32: 4_000_000_000,
        V.INT32: -2_000_000_000,
        V.UINT64: 2**63 + 5,
        V.INT64: -(2**62),
        V.FLOAT32: 1.5,
        V.FLOAT64: -2.25,
        V.BOOL: True,
        V.STRING: "h\u00e9llo \U0001f600",
    }
    fields = {f"x.{kind.name.lower()}": (value, kind) for kind, value in scalars.items()}
    fields.update({f"x.{kind.name.lower()}s": ([value] * 3, V.ARRAY, kind) for kind, value in scalars.items()})
    return fields


def test_gguf_reader_reads_what_the_gguf_package_reads(tmp_path):
    """Metadata of every value type and tensors of several GGML types (with the alignment the file asks
    for) read by batchgpu's reader equal what the gguf package's own reader makes of them."""
    from batchgpu.models.gguf_reader import SCALARS, GGUFFile

    assert {kind: dtype.type for kind, dtype in SCALARS.items()} == {
        int(kind): np.dtype(dtype).type for kind, dtype in gguf.GGUFReader.gguf_scalar_to_np.items()
    }
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, spec in every_value_type().items():
        writer.add_key_value(key, *spec)
    writer.data_alignment = 64
    writer.add_key_value("general.alignment", 64, V.UINT32)
    rng = np.random.default_rng(5)
    matrix = rng.standard_normal((3, 64)).astype(np.float32)
    writer.add_tensor("f32", matrix)
    writer.add_tensor("f16", matrix.astype(np.float16))
    blocks, kind = q8_rows(matrix)
    writer.add_tensor("q8_0", blocks, raw_dtype=kind)
    writer.add_tensor("vector", rng.standard_normal(7).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    assert set(ours.metadata) == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for key, value in ours.metadata.items():
        value = value.tolist() if isinstance(value, np.ndarray) else value
        assert value == theirs.fields[key].contents() and type(value) is type(theirs.fields[key].contents()), key
    assert ours.tensors.keys() == {t.name for t in theirs.tensors}
    for tensor in theirs.tensors:
        mine = ours.tensors[tensor.name]
        assert (mine.kind, mine.shape, mine.offset, mine.size) == (
            tensor.tensor_type.name,
            tuple(int(d) for d in reversed(tensor.shape)),
            tensor.data_offset,
            tensor.n_bytes,
        )
        assert mine.offset % 64 == 0
        np.testing.assert_array_equal(ours.data(mine), np.asarray(tensor.data).view(np.uint8).reshape(-1))


def test_gguf_metadata_items_are_bounded(tmp_path, monkeypatch):
    """Arrays past the metadata's item budget are refused before they are read (the budget is far above
    real vocabularies; here it is lowered to keep the file small)."""
    from batchgpu.models import gguf_reader

    path = write_model_gguf(tmp_path / "model.gguf")
    monkeypatch.setattr(gguf_reader, "MAX_METADATA_ITEMS", 2 * D["vocab"] - 1)
    with pytest.raises(ModelFileError, match=r"'tokenizer\.ggml\.token_type' takes the metadata's array items to 100"):
        gguf_reader.GGUFFile(path)


def test_safetensors_files_the_library_writes_are_read(tmp_path):
    """Headers the safetensors library writes (scalars, empty tensors, every dtype read here, metadata) pass
    the checks and map the library's own values."""
    from safetensors.numpy import load_file, save_file

    from batchgpu.models.safetensors_file import read_header

    rng = np.random.default_rng(3)
    tensors = {
        "scalar": np.array(2.5, np.float32),
        "empty": np.zeros((0, 5), np.float16),
        "matrix": rng.standard_normal((3, 7)).astype(np.float32),
        "halves": rng.standard_normal((4,)).astype(np.float16),
    }
    file = tmp_path / "x.safetensors"
    save_file(tensors, str(file), metadata={"format": "pt"})
    stored = read_header(file)
    for name, array in load_file(str(file)).items():
        assert stored[name].shape == array.shape
        np.testing.assert_array_equal(stored[name].array(), array)
