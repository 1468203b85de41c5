"""A BERT-family text encoder (``model_type`` ``"bert"``: all-MiniLM, BGE, E5, GTE and the like) from a
sentence-transformers directory (batchgpu/models/sentence.py), computing sentence embeddings on the device.

The forward pass is BERT's: word + position + token-type (type 0) embeddings and a LayerNorm, then per layer
bidirectional attention over the text's own tokens (padding keys masked out), a residual LayerNorm, a GELU
(erf) feed-forward and another residual LayerNorm (post-norm); then mean or CLS pooling over the text's
tokens and, where the pipeline has a Normalize module, L2 normalization. Many texts run as one batch padded
to one length; a batch is recorded once per (rows, length) shape, both rounded up to powers of two, and
its rows and tokens are bounded by the queried device limits."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..batch import GpuCommandBatch
from ..device import Device
from ..errors import ArgumentError, BatchError, ModelFileError
from ..tensor import Tensor
from .fields import Fields
from .files import optional_file, read_json
from .safetensors_dir import read_checkpoint
from .safetensors_file import Stored
from .sentence import Pooling, SentenceModel

ENCODER_TYPES = ("bert",)
"""Hugging Face ``model_type`` values encoded here."""

MASKED = 1e30
"""Added (negated) to the attention scores of padding keys: their softmax weight underflows to exactly 0."""
MEAN_FLOOR, NORM_FLOOR = 1e-9, 1e-12
"""sentence-transformers' floors: the token count of mean pooling, the vector norm of Normalize."""
MIN_LENGTH = 8
"""The shortest padded length of a batch (shorter texts share one recorded batch)."""
DEFAULT_MAX_BATCH, DEFAULT_BATCH_TOKENS = 32, 8192
"""Texts per device batch (sentence-transformers' default batch size) and padded tokens per batch."""
KEPT_BATCHES = 8
"""Recorded batches kept (least recently used released first): each holds its own activations."""

SIZES = {
    "num_hidden_layers": ("layers", 1, 1024),
    "hidden_size": ("hidden", 1, 1 << 16),
    "num_attention_heads": ("heads", 1, 1 << 12),
    "intermediate_size": ("ffn", 1, 1 << 18),
    "vocab_size": ("vocab", 1, 1 << 22),
    "max_position_embeddings": ("positions", 2, 1 << 16),
    "type_vocab_size": ("types", 1, 1 << 10),
}
"""config.json key -> (EncoderConfig field, lowest, highest)."""

REQUIRED_SETTINGS = {
    "hidden_act": "gelu",
    "position_embedding_type": "absolute",
    "is_decoder": False,
    "add_cross_attention": False,
}
"""config.json keys whose value must be this (absent: the default, the same) for the forward pass here."""


@dataclass(frozen=True)
class EncoderConfig:
    """The shape of a BERT encoder, from config.json (each size bounded, see :data:`SIZES`)."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    positions: int
    types: int
    eps: float

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def from_hf(cls, settings: Fields) -> EncoderConfig:
        """The config of a Hugging Face ``config.json`` (ModelFileError naming a field out of range)."""
        model_type = settings.text("model_type", choices=ENCODER_TYPES)
        for key, value in REQUIRED_SETTINGS.items():
            got = settings.raw(key, value)
            if type(got) is not type(value) or got != value:
                raise settings.refuse(key, f"{value!r} (what a {model_type} encoder computes here)", got)
        sizes = {field: settings.integer(key, low=low, high=high) for key, (field, low, high) in SIZES.items()}
        if sizes["hidden"] % sizes["heads"]:
            raise settings.refuse("num_attention_heads", f"a divisor of hidden_size {sizes['hidden']}", sizes["heads"])
        eps = settings.number("layer_norm_eps", 1e-12, positive=True)
        return cls(**sizes, eps=eps)


def layer_tensors(config: EncoderConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """One layer's tensor names -> shapes."""
    h, f = config.hidden, config.ffn
    block = f"encoder.layer.{layer}."
    shapes = {
        "attention.self.query": (h, h),
        "attention.self.key": (h, h),
        "attention.self.value": (h, h),
        "attention.output.dense": (h, h),
        "intermediate.dense": (f, h),
        "output.dense": (h, f),
    }
    tensors = {}
    for name, shape in shapes.items():
        tensors[f"{block}{name}.weight"], tensors[f"{block}{name}.bias"] = shape, shape[:1]
    for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
        tensors[f"{block}{norm}.weight"] = tensors[f"{block}{norm}.bias"] = (h,)
    return tensors


def expected_tensors(config: EncoderConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the encoder computes with, by its Hugging Face name, and its shape."""
    h = config.hidden
    tensors = {
        "embeddings.word_embeddings.weight": (config.vocab, h),
        "embeddings.position_embeddings.weight": (config.positions, h),
        "embeddings.token_type_embeddings.weight": (config.types, h),
        "embeddings.LayerNorm.weight": (h,),
        "embeddings.LayerNorm.bias": (h,),
    }
    for layer in range(config.layers):
        tensors.update(layer_tensors(config, layer))
    return tensors


FLOAT_DTYPES = ("F32", "F16", "BF16")
POSITION_IDS = "embeddings.position_ids"
IGNORED = ("pooler.dense.weight", "pooler.dense.bias")
"""Tensors of a BertModel checkpoint that sentence-transformers does not use (the pooler head)."""


def check_checkpoint(config: EncoderConfig, stored: dict[str, Stored]) -> dict[str, Stored]:
    """The tensors the encoder computes with, each of the shape the config implies; ModelFileError for a
    missing, misshapen or unknown tensor, or a ``position_ids`` buffer that is not ``0, 1, 2, ...``."""
    expected = expected_tensors(config)
    for name, tensor in stored.items():
        if name in IGNORED:
            continue
        if name == POSITION_IDS:
            check_position_ids(tensor, config.positions)
        elif name not in expected:
            raise ModelFileError(
                f"{tensor.file}: tensor {name!r} is not part of a BERT encoder of {config.layers} layers; refusing "
                "rather than computing without it"
            )
    for name, shape in expected.items():
        if name not in stored:
            raise ModelFileError(f"the checkpoint has no tensor {name!r} (shape {shape})")
        tensor = stored[name]
        if tensor.shape != shape:
            raise ModelFileError(
                f"{tensor.file}: tensor {name!r} must have the shape config.json implies, {shape}, got {tensor.shape}"
            )
        if tensor.dtype not in FLOAT_DTYPES:
            raise ModelFileError(
                f"{tensor.file}: tensor {name!r} dtype must be one of {', '.join(FLOAT_DTYPES)}, got {tensor.dtype}"
            )
    return {name: stored[name] for name in expected}


def check_position_ids(tensor: Stored, positions: int) -> None:
    """The ``position_ids`` buffer older checkpoints carry must be ``[[0, 1, ..., positions - 1]]``."""
    if tensor.shape != (1, positions) or tensor.dtype != "I64":
        raise ModelFileError(
            f"{tensor.file}: tensor {POSITION_IDS!r} must be I64 of shape (1, {positions}), got {tensor.dtype} "
            f"of shape {tensor.shape}"
        )
    if not np.array_equal(tensor.array()[0], np.arange(positions)):
        raise ModelFileError(f"{tensor.file}: tensor {POSITION_IDS!r} must be 0, 1, ..., {positions - 1}")


def float32(tensor: Stored) -> np.ndarray:
    """A stored float tensor as float32 (bfloat16: its 16 bits are a float32's top half)."""
    data = tensor.array()
    if tensor.dtype == "BF16":
        return (data.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(data, np.float32)


def is_encoder(path: Path | str) -> bool:
    """Whether ``path`` is a model directory whose config.json names an encoder (:data:`ENCODER_TYPES`)."""
    directory = Path(path)
    config_file = optional_file(directory, "config.json") if directory.is_dir() else None
    if config_file is None:
        return False
    return Fields(read_json(config_file), config_file).raw("model_type", None) in ENCODER_TYPES


# the forward pass ------------------------------------------------------------------------------------


def linear(
    batch: GpuCommandBatch, params: dict[str, Tensor], x: Tensor, name: str, activation: str | None = None
) -> Tensor:
    """``x @ W^T + b`` of the Linear ``name`` (weights stored (out, in), as PyTorch keeps them)."""
    extra = {} if activation is None else {"activation": activation}
    return batch.matmul(x, params[f"{name}.weight"], transpose_b=True, bias=params[f"{name}.bias"], **extra)


def layer_norm(batch: GpuCommandBatch, params: dict[str, Tensor], x: Tensor, name: str, eps: float) -> Tensor:
    return batch.layer_norm(x, params[f"{name}.weight"], params[f"{name}.bias"], eps)


def attention(
    batch: GpuCommandBatch, config: EncoderConfig, params: dict[str, Tensor], x: Tensor, bias: Tensor, block: str
) -> Tensor:
    """Bidirectional multi-head self-attention of ``x`` (rows * length, hidden); ``bias`` (rows, 1, 1,
    length) is 0 for a text's tokens and -:data:`MASKED` for padding keys."""
    rows, length = bias.shape[0], bias.shape[3]

    def heads(name: str) -> Tensor:
        projected = linear(batch, params, x, f"{block}attention.self.{name}")
        return batch.permute(batch.reshape(projected, (rows, length, config.heads, config.head_dim)), (0, 2, 1, 3))

    q, k, v = heads("query"), heads("key"), heads("value")
    scores = batch.mul(batch.matmul(q, k, transpose_b=True), 1.0 / math.sqrt(config.head_dim))
    weights = batch.softmax(batch.add(scores, bias), axis=-1)
    context = batch.permute(batch.matmul(weights, v), (0, 2, 1, 3))
    return batch.reshape(context, (rows * length, config.hidden))


def record_layer(
    batch: GpuCommandBatch, config: EncoderConfig, params: dict[str, Tensor], x: Tensor, bias: Tensor, layer: int
) -> Tensor:
    """One post-norm encoder layer over ``x`` (rows * length, hidden)."""
    block = f"encoder.layer.{layer}."
    attended = linear(batch, params, attention(batch, config, params, x, bias, block), f"{block}attention.output.dense")
    x = layer_norm(batch, params, batch.add(x, attended), f"{block}attention.output.LayerNorm", config.eps)
    hidden = linear(batch, params, x, f"{block}intermediate.dense", activation="gelu")
    out = linear(batch, params, hidden, f"{block}output.dense")
    return layer_norm(batch, params, batch.add(x, out), f"{block}output.LayerNorm", config.eps)


def record_encoder(
    batch: GpuCommandBatch,
    config: EncoderConfig,
    params: dict[str, Tensor],
    ids: Tensor,
    mask: Tensor,
    pooling: Pooling,
    normalize: bool,
) -> Tensor:
    """The text vectors (rows, hidden) of int32 token ``ids`` (rows, length) whose float32 ``mask`` is 1
    on each text's tokens and 0 on padding."""
    rows, length = ids.shape
    words = batch.embedding(ids, params["embeddings.word_embeddings.weight"])
    types = batch.slice(params["embeddings.token_type_embeddings.weight"], (slice(0, 1),))
    positions = batch.slice(params["embeddings.position_embeddings.weight"], (slice(0, length),))
    embedded = batch.reshape(batch.add(batch.add(words, types), positions), (rows * length, config.hidden))
    x = layer_norm(batch, params, embedded, "embeddings.LayerNorm", config.eps)
    bias = batch.reshape(batch.mul(batch.sub(mask, 1.0), MASKED), (rows, 1, 1, length))
    for layer in range(config.layers):
        x = record_layer(batch, config, params, x, bias, layer)
    tokens = batch.reshape(x, (rows, length, config.hidden))
    if pooling is Pooling.CLS:
        pooled = batch.reshape(batch.slice(tokens, (slice(None), slice(0, 1))), (rows, config.hidden))
    else:
        summed = batch.sum(batch.mul(tokens, batch.reshape(mask, (rows, length, 1))), axis=1)
        counts = batch.maximum(batch.sum(mask, axis=1, keepdims=True), MEAN_FLOOR)
        pooled = batch.div(summed, counts)
    if not normalize:
        return pooled
    norms = batch.sqrt(batch.sum(batch.mul(pooled, pooled), axis=1, keepdims=True))
    return batch.div(pooled, batch.maximum(norms, NORM_FLOOR))


# batches ---------------------------------------------------------------------------------------------


def power_of_two(n: int) -> int:
    """The least power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class Group:
    """Texts run together: their indices (into the caller's list) and the padded (rows, length)."""

    indices: tuple[int, ...]
    rows: int
    length: int


def plan_groups(lengths: Sequence[int], max_rows: int, max_tokens: int, max_length: int) -> list[Group]:
    """Texts of token counts ``lengths`` in groups, longest first: each group pads to a power-of-two length
    (at least :data:`MIN_LENGTH`, at most ``max_length``) and has a power-of-two row count of at most
    ``max_rows`` and of at most ``max_tokens`` padded tokens (one row at least)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups, start = [], 0
    while start < len(order):
        length = min(max(power_of_two(lengths[order[start]]), MIN_LENGTH), max_length)
        cap = max(1, min(max_rows, max_tokens // length))
        cap = 1 << (cap.bit_length() - 1)  # a power of two
        taken = tuple(order[start : start + cap])
        groups.append(Group(taken, min(power_of_two(len(taken)), cap), length))
        start += len(taken)
    return groups


@dataclass
class RecordedBatch:
    batch: GpuCommandBatch
    ids: Tensor
    mask: Tensor
    vectors: Tensor


class Encoder:
    """A sentence-transformers BERT model on one device: text -> vector. ``max_batch`` texts (and at most
    ``max_batch_tokens`` padded tokens, and what the device's buffer limits allow) run as one batch."""

    def __init__(
        self,
        device: Device,
        path: Path | str,
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
    ) -> None:
        for what, value in (("max_batch", max_batch), ("max_batch_tokens", max_batch_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ArgumentError(f"Encoder: {what} must be an int >= 1, got {value!r}")
        self.device, self.path = device, Path(path)
        config_file = optional_file(self.path, "config.json")
        if config_file is None:
            raise BatchError(f"{self.path}: no config.json (a Hugging Face model directory has one)")
        self.config = EncoderConfig.from_hf(Fields(read_json(config_file), config_file))
        cfg = self.config
        self.model = SentenceModel.read(self.path, cfg.hidden, cfg.positions, cfg.vocab)
        stored = check_checkpoint(self.config, read_checkpoint(self.path))
        self.max_batch = min(max_batch, self.rows_allowed(MIN_LENGTH))
        self.max_batch_tokens = max_batch_tokens
        self.params = {name: device.tensor(float32(tensor), name=name) for name, tensor in stored.items()}
        self._batches: OrderedDict[tuple[int, int], RecordedBatch] = OrderedDict()

    @property
    def dimensions(self) -> int:
        """The length of a text's vector."""
        return self.config.hidden

    @property
    def max_length(self) -> int:
        """The most tokens of a text (special tokens included); longer texts are truncated."""
        return self.model.max_seq_length

    def rows_allowed(self, length: int) -> int:
        """The most rows a batch of ``length`` tokens may have for its largest activation (the attention
        scores or the feed-forward's) to fit one storage binding of the device."""
        cfg = self.config
        per_row = 4 * length * max(cfg.heads * length, cfg.ffn, cfg.hidden)
        limits = self.device.limits
        rows = min(limits.max_storage_buffer_binding_size, limits.max_buffer_size) // per_row
        if rows < 1:
            raise BatchError(f"Encoder: one text of {length} tokens needs {per_row} bytes per buffer; the device "
                             f"binds at most {limits.max_storage_buffer_binding_size}")  # fmt: skip
        return rows

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text as sentence-transformers makes them: stripped, lower-cased where the
        directory says so, special tokens added, truncated at :attr:`max_length` tokens."""
        if isinstance(texts, str) or not all(isinstance(text, str) for text in texts):
            raise ArgumentError("Encoder.tokenize: texts must be a sequence of strings")
        prepared = [text.strip().lower() if self.model.lower_case else text.strip() for text in texts]
        return [encoding.ids for encoding in self.model.tokenizer.encode_batch(prepared)]

    def check_ids(self, ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Each token-id list as int32, checked: 1 to :attr:`max_length` ids, each in [0, vocab)."""
        arrays = []
        for index, row in enumerate(ids):
            array = np.asarray(row)
            if array.ndim != 1 or not 1 <= len(array) <= self.max_length or array.dtype.kind not in "iu":
                raise ArgumentError(
                    f"Encoder: input {index} must be 1 to {self.max_length} token ids, got {len(array)} "
                    f"of {array.dtype}"
                )
            if array.min() < 0 or array.max() >= self.config.vocab:
                raise ArgumentError(
                    f"Encoder: input {index} has token id {int(array.max() if array.max() >= 0 else array.min())}; "
                    f"ids must be in [0, {self.config.vocab})"
                )
            arrays.append(array.astype(np.int32))
        return arrays

    def groups(self, ids: Sequence[np.ndarray]) -> list[Group]:
        """How :meth:`embed` splits texts of these ids into device batches."""
        lengths = [len(row) for row in ids]
        rows = min(self.max_batch, self.rows_allowed(min(power_of_two(max(lengths, default=1)), self.max_length)))
        return plan_groups(lengths, rows, self.max_batch_tokens, self.max_length)

    def recorded(self, rows: int, length: int) -> RecordedBatch:
        """The batch of ``rows`` texts of ``length`` tokens (recorded on first use; kept LRU)."""
        key = (rows, length)
        if key in self._batches:
            self._batches.move_to_end(key)
            return self._batches[key]
        batch = GpuCommandBatch(self.device, name=f"encoder_{rows}x{length}")
        ids = batch.upload(np.zeros((rows, length), np.int32), name="ids")
        mask = batch.upload(np.zeros((rows, length), np.float32), name="mask")
        vectors = record_encoder(batch, self.config, self.params, ids, mask, self.model.pooling, self.model.normalize)
        batch.outputs(vectors)
        self._batches[key] = RecordedBatch(batch, ids, mask, vectors)
        if len(self._batches) > KEPT_BATCHES:
            self._batches.popitem(last=False)[1].batch.release()
        return self._batches[key]

    def feeds(self, group: Group, ids: Sequence[np.ndarray]) -> tuple[RecordedBatch, dict[Tensor, np.ndarray]]:
        """The group's recorded batch and its padded inputs."""
        step = self.recorded(group.rows, group.length)
        tokens = np.zeros((group.rows, group.length), np.int32)
        mask = np.zeros((group.rows, group.length), np.float32)
        for row, index in enumerate(group.indices):
            tokens[row, : len(ids[index])] = ids[index]
            mask[row, : len(ids[index])] = 1.0
        return step, {step.ids: tokens, step.mask: mask}

    def _prepare(self, inputs: Sequence[str | Sequence[int]]) -> list[np.ndarray]:
        if isinstance(inputs, str):
            inputs = [inputs]
        texts = [i for i, item in enumerate(inputs) if isinstance(item, str)]
        tokenized = dict(zip(texts, self.tokenize([inputs[i] for i in texts]))) if texts else {}
        return self.check_ids([tokenized.get(i, item) for i, item in enumerate(inputs)])

    def embed(self, inputs: str | Sequence[str | Sequence[int]]) -> np.ndarray:
        """The vectors (n, :attr:`dimensions`, float32) of ``inputs``: texts, or token-id lists taken as the
        model's whole input (special tokens included)."""
        ids = self._prepare(inputs)
        out = np.zeros((len(ids), self.dimensions), np.float32)
        for group in self.groups(ids):
            step, feeds = self.feeds(group, ids)
            out[list(group.indices)] = step.batch.execute(feeds).read(step.vectors)[: len(group.indices)]
        return out

    async def embed_async(self, inputs: str | Sequence[str | Sequence[int]]) -> np.ndarray:
        """:meth:`embed` for asyncio code: awaits each batch's read (the event loop runs meanwhile)."""
        ids = self._prepare(inputs)
        out = np.zeros((len(ids), self.dimensions), np.float32)
        for group in self.groups(ids):
            step, feeds = self.feeds(group, ids)
            submission = await step.batch.execute_async(feeds)
            out[list(group.indices)] = (await submission.read_async(step.vectors))[: len(group.indices)]
        return out

    def release(self) -> None:
        """Free the recorded batches (the weights stay resident on the device)."""
        while self._batches:
            self._batches.popitem()[1].batch.release()
