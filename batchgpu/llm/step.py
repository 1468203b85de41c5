"""One recorded forward step of a Llama-family model over ``rows`` token rows, sampling ``samples`` next
tokens on the device. The engine records decode steps (one row per decoding sequence, every row sampled)
and mixed steps (a row per decoding sequence, then pieces of prompts, each piece's last row sampled, kept
where its prompt ends there), each at a ladder of row counts. Everything that changes per step is an
input: token ids, positions, the paged KV cache rows to write, block tables, sequence lengths, sampling
parameters and keys; only the sampled ids come back, and for the rows that asked, their logprobs (never
the logits). A plan is packed into the step's preallocated host arrays (:mod:`~batchgpu.llm.feeds`) and
only the inputs that changed since the step's previous run are uploaded."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..batch import GpuCommandBatch, Submission
from ..device import Device
from ..errors import ShapeError
from ..models.config import LlamaConfig
from ..models.decoder import PagedKV, record_decoder, record_logits
from ..ops.sampling import MAX_TOP
from ..tensor import Tensor
from .feeds import (
    SlotTable,
    StepFeeds,
    guided,
    pack_decode,
    pack_masks,
    pack_mixed,
    pack_verify,
    wants_prompt_logprobs,
)
from .scheduler import SCORING_ROWS, StepKind, StepPlan


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model's raw distribution (log-softmax of the logits, before
    temperature, penalties and truncation, as vLLM reports it) and the ``top`` (id, logprob) pairs of that
    position, most likely first. ``logprob`` is None for a prompt's first token (nothing precedes it).
    ``token_bytes`` and ``top_bytes``: what the token and each top id add to the text at that place (the output's
    or the prompt's; :class:`~batchgpu.models.token_bytes.TokenReader`), filled in by the request's output
    processor."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()
    token_bytes: bytes = b""
    top_bytes: tuple[bytes, ...] = ()


def token_logprob(row: np.ndarray, token: int) -> TokenLogprob:
    """The :class:`TokenLogprob` of ``token`` from one row of the ``logprobs`` op (its target's logprob, then
    MAX_TOP ids and their logprobs; ids -1 past the ranks the row asked for)."""
    ids = row[1 : 1 + MAX_TOP]
    ranks = int((ids >= 0).sum())
    top = tuple((int(i), float(v)) for i, v in zip(ids[:ranks], row[1 + MAX_TOP : 1 + MAX_TOP + ranks]))
    return TokenLogprob(token, float(row[0]), top)


@dataclass
class KVCache:
    """The paged KV cache on the device: per layer one key and one value pool of ``blocks * block_size``
    rows, per slot the token counts the penalties read (``seen``: prompt and output, ``generated``:
    output only) and the slot's latest sampled token (``tokens``, (slots, 1): a decode step's input,
    written by the step before). Resident tensors, shared by every recorded step."""

    keys: list[Tensor]
    values: list[Tensor]
    seen: Tensor
    generated: Tensor
    tokens: Tensor
    block_size: int
    blocks: int
    logits: Tensor | None = None  # (rows, vocab) float32: a split step's logits, allocated on first use

    @classmethod
    def allocate(
        cls, device: Device, config: LlamaConfig, *, blocks: int, block_size: int, slots: int, dtype: np.dtype
    ) -> KVCache:
        rows = (blocks * block_size, config.kv_heads, config.head_dim)
        zeros = np.zeros(rows, dtype)
        keys = [device.tensor(zeros, name=f"kv.k{i}") for i in range(config.layers)]
        values = [device.tensor(zeros, name=f"kv.v{i}") for i in range(config.layers)]
        counts = np.zeros((slots, config.vocab), np.int32)
        return cls(
            keys,
            values,
            device.tensor(counts, name="seen"),
            device.tensor(counts, name="generated"),
            device.tensor(np.zeros((slots, 1), np.int32), name="tokens"),
            block_size,
            blocks,
        )

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.keys, *self.values))

    def logits_store(self, device: Device, vocab: int, rows: int) -> Tensor:
        """The resident (rows, vocab) float32 rows where a split step's forward part leaves its logits for
        its sampling part (allocated the first time a split step is recorded, with room for ``rows``: the most
        samples any step of the engine has)."""
        if self.logits is None:
            self.logits = device.tensor(np.zeros((rows, vocab), np.float32), name="logits")
        return self.logits


@dataclass
class Step:
    """A recorded step, its input and output tensors (see :func:`record_step`) and ``feeds``, the host
    arrays its inputs are packed into (:class:`~batchgpu.llm.feeds.StepFeeds`)."""

    batch: GpuCommandBatch
    rows: int
    samples: int
    inputs: dict[str, Tensor]
    next_ids: Tensor
    logprobs: Tensor
    prompt_logprobs: Tensor | None = None
    forward: GpuCommandBatch | None = None  # a split step's forward part (``batch``: its sampling part)
    feeds: StepFeeds = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.feeds = StepFeeds({name: (t.shape, t.dtype) for name, t in self.inputs.items()})

    def run(self, feeds: dict[str, np.ndarray]) -> Submission:
        """Execute with the named inputs (those not named keep the values of the step's previous run); the
        submission reads ``next_ids`` later. A split step runs its forward part alone (then
        :meth:`run_sample`)."""
        if self.forward is None:
            return self.batch.execute({self.inputs[name]: value for name, value in feeds.items()})
        named = {name: value for name, value in feeds.items() if name in FORWARD_INPUTS}
        return self.forward.execute({self.inputs[name]: value for name, value in named.items()})

    def run_sample(self, feeds: dict[str, np.ndarray]) -> Submission:
        """A split step's sampling part (after :meth:`run`), whose submission reads ``next_ids``."""
        named = {name: value for name, value in feeds.items() if name not in FORWARD_INPUTS}
        return self.batch.execute({self.inputs[name]: value for name, value in named.items()})

    def run_packed(self) -> Submission:
        """Execute with :attr:`feeds` as packed, uploading only the arrays that changed since the previous
        run (every one after a failed run); a split step's forward part alone (then :meth:`sample_packed`)."""
        return self.packed(self.run, done=self.forward is None)

    def sample_packed(self) -> Submission:
        """A split step's sampling part with :attr:`feeds` as they are now (its masks filled)."""
        return self.packed(self.run_sample, done=True)

    def packed(self, run: Callable[[dict[str, np.ndarray]], Submission], *, done: bool) -> Submission:
        """``run`` with the arrays that changed; ``done``: the step's inputs now hold every array."""
        try:
            submission = run(self.feeds.changed())
        except BaseException:
            self.feeds.forget()
            raise
        if done:
            self.feeds.ran()
        return submission


FORWARD_INPUTS = frozenset(
    {"ids", "sources", "token_slots", "positions", "kv_rows", "seq", "lengths", "block_tables", "sample_rows"}
    | {"count_slots"}
    | {"generated_slots", "reset", "score_rows", "prompt_targets", "prompt_n"}
)
"""A step's inputs that its forward part reads (the others: its sampling part)."""


def record_step(
    device: Device,
    config: LlamaConfig,
    weights: dict[str, Tensor],
    cache: KVCache,
    *,
    rows: int,
    samples: int,
    table_rows: int,
    max_blocks: int,
    name: str,
    mixed: bool,
    by_slot: bool,
    scoring: int = 0,
    masked: bool = False,
    split: bool = False,
    store_rows: int = 0,
) -> Step:
    """Record the step. Inputs (each keeps its value until fed again):

    - a decode step's ``token_slots`` (rows,): the slot whose latest sampled token (``cache.tokens``, on the
      device) each row decodes; a mixed step's ``ids`` (rows,), its prompt rows' tokens, and ``sources``
      (rows,): where each row's token is, a slot of ``cache.tokens`` (a decode row) or ``slots + row`` (the
      row's own entry of ``ids``);
    - ``positions`` (rows,): each row's position in its sequence;
    - ``kv_rows`` (rows,): the pool row each row's key and value go to (-1: an idle row, nothing written);
    - ``seq``, ``lengths`` (rows,): the block-table row of each row's sequence and how many positions it
      attends over (its position + 1: causal; 0: idle);
    - ``block_tables`` (table_rows, max_blocks): each sequence's KV blocks;
    - ``sample_rows`` (samples,): the row whose logits each sample uses; ``sample_slots`` (samples,): its
      slot (the counts row; with ``by_slot``, sample i is slot i's and the counts are read directly);
      ``penalties`` (samples, 3), ``sampling`` (samples, 4), ``top_k`` (samples,), ``keys`` (samples, 2):
      see :meth:`GpuCommandBatch.sample`;
    - ``sampled_slots`` (samples,): slot each sampled token is counted for and stored in ``cache.tokens``
      for (-1: not a real token, e.g. a prompt chunk that does not end the prompt);
    - with ``mixed`` also ``count_slots`` (rows,), ``generated_slots`` (rows,), ``reset``
      (slots,): the slot (or -1) each row's token counts for in ``seen``, and in ``generated`` (a row of a
      preempted sequence's output, run again), slots whose counts start over (a new sequence). Decode
      rows count only the tokens they sample;
    - ``logprob_n`` (samples,): the top ids each sample's logprobs give (-1: the sample asks for none);
    - with ``scoring`` rows scored (a mixed step for prompts that ask for their own logprobs: the head runs on
      those rows) also ``score_rows`` (scoring,): the rows scored, ``prompt_targets`` (scoring,): the prompt
      token after each, and ``prompt_n`` (scoring,): the top ids its logprobs give (-1: not asked);
    - with ``masked`` (a step with rows of structured outputs) also ``allowed`` (samples, ceil(vocab / 32))
      uint32: each sample's allowed-token bitmask, read for the samples whose ``sampling[:, 3]`` is 1.
    With ``split`` (a step whose masks are filled while its forward part runs), two batches: the
    forward part (the inputs of :data:`FORWARD_INPUTS`) leaves its logits in ``cache.logits``, the
    sampling part (the other inputs) samples from them; the store has ``store_rows`` rows (at least
    ``samples``: the most any step of the engine samples).
    Outputs: ``next_ids`` (samples,) int32; ``logprobs`` (samples, 41) float32, the ``logprobs`` op's rows of
    the raw logits at each sampled id; with ``scoring``, ``prompt_logprobs`` (scoring, 41).
    """
    batch = GpuCommandBatch(device, name=name)
    sampler = GpuCommandBatch(device, name=f"{name}-sample") if split else batch
    slots = cache.seen.shape[0]

    def inp(label: str, shape: tuple[int, ...], dtype: type) -> Tensor:
        part = batch if label in FORWARD_INPUTS else sampler
        return part.upload(np.zeros(shape, dtype), name=label)

    sources = ("ids", "sources") if mixed else ("token_slots",)
    inputs = {name: inp(name, (rows,), np.int32) for name in sources}
    inputs |= {
        "positions": inp("positions", (rows,), np.int32),
        "kv_rows": inp("kv_rows", (rows,), np.int32),
        "seq": inp("seq", (rows,), np.int32),
        "lengths": inp("lengths", (rows,), np.int32),
        "block_tables": inp("block_tables", (table_rows, max_blocks), np.int32),
        "sample_rows": inp("sample_rows", (samples,), np.int32),
        "sample_slots": inp("sample_slots", (samples,), np.int32),
        "penalties": inp("penalties", (samples, 3), np.float32),
        "sampling": inp("sampling", (samples, 4), np.float32),
        "top_k": inp("top_k", (samples,), np.int32),
        "keys": inp("keys", (samples, 2), np.uint32),
        "sampled_slots": inp("sampled_slots", (samples,), np.int32),
    }
    inputs["logprob_n"] = inp("logprob_n", (samples,), np.int32)
    if mixed:
        inputs["count_slots"] = inp("count_slots", (rows,), np.int32)
        inputs["generated_slots"] = inp("generated_slots", (rows,), np.int32)
        inputs["reset"] = inp("reset", (slots,), np.int32)
    if masked:
        inputs["allowed"] = inp("allowed", (samples, (config.vocab + 31) // 32), np.uint32)
    if scoring:
        inputs |= {name: inp(name, (scoring,), np.int32) for name in ("score_rows", "prompt_targets", "prompt_n")}
    x = inputs
    if mixed:  # a decode row's token where the step before left it, a prompt row's from the host
        known = batch.concat([cache.tokens, batch.reshape(x["ids"], (rows, 1))])
        ids = batch.reshape(batch.embedding(x["sources"], known), (rows,))
    else:
        ids = batch.reshape(batch.embedding(x["token_slots"], cache.tokens), (rows,))
    kv = PagedKV(
        cache.keys,
        cache.values,
        positions=x["positions"],
        rows=x["kv_rows"],
        block_tables=x["block_tables"],
        seq=x["seq"],
        lengths=x["lengths"],
        block_size=cache.block_size,
    )
    normed = record_decoder(batch, config, weights, ids, kv)
    prompt_logprobs = None
    if scoring:  # the scored rows' logits: each one's logprobs of the prompt token after it
        scored = record_logits(batch, weights, batch.embedding(x["score_rows"], normed))
        prompt_logprobs = batch.logprobs(scored, x["prompt_targets"], x["prompt_n"])
    logits = record_logits(batch, weights, batch.embedding(x["sample_rows"], normed))
    if mixed:  # prompt tokens count before this step's sampling (HF's repetition penalty covers the prompt)
        batch.count_tokens(cache.seen, x["count_slots"], x["ids"], x["reset"])
        batch.count_tokens(cache.generated, x["generated_slots"], x["ids"], x["reset"])
    if split:  # the logits go through the resident store to the sampling part
        store, rows_of = cache.logits_store(device, config.vocab, store_rows), np.arange(samples, dtype=np.int32)
        if samples > store.shape[0]:  # (the scatter would leave the samples past it without logits)
            raise ShapeError(f"record_step: {samples} samples, the split steps' logits store holds {store.shape[0]}")
        batch.scatter_rows(store, batch.upload(rows_of, name="store_rows"), logits)
        logits = sampler.embedding(sampler.upload(rows_of, name="store_rows"), store)
    next_ids, logprobs = record_sampling(sampler, cache, x, logits, samples=samples, by_slot=by_slot)
    sampler.outputs(next_ids, logprobs, *([prompt_logprobs] if prompt_logprobs is not None else []))
    return Step(sampler, rows, samples, inputs, next_ids, logprobs, prompt_logprobs, batch if split else None)


def record_sampling(
    batch: GpuCommandBatch, cache: KVCache, x: dict[str, Tensor], logits: Tensor, *, samples: int, by_slot: bool
) -> tuple[Tensor, Tensor]:
    """A step's sampling from ``logits`` (samples, vocab): penalties, the (masked) draw, the sampled ids'
    logprobs, their counts and their place in ``cache.tokens``; returns ``(next_ids, logprobs)``."""
    slots = cache.seen.shape[0]
    if by_slot:  # sample i is slot i's: its counts row is its own
        if samples != slots:
            raise ValueError(f"record_step: by_slot needs one sample per slot ({slots}), got {samples}")
        seen, generated = cache.seen, cache.generated
    else:
        seen = batch.embedding(x["sample_slots"], cache.seen)
        generated = batch.embedding(x["sample_slots"], cache.generated)
    penalized = batch.penalize(logits, seen, generated, x["penalties"])
    next_ids = batch.sample(penalized, x["sampling"], x["top_k"], x["keys"], x.get("allowed"))
    logprobs = batch.logprobs(logits, next_ids, x["logprob_n"])  # the raw logits: before the penalties
    batch.count_tokens(cache.seen, x["sampled_slots"], next_ids)
    batch.count_tokens(cache.generated, x["sampled_slots"], next_ids)
    batch.scatter_rows(cache.tokens, x["sampled_slots"], batch.reshape(next_ids, (samples, 1)))
    return next_ids, logprobs


# running a plan ------------------------------------------------------------------------------------------


def step_sizes(largest: int, every: int = 0) -> list[int]:
    """The row counts a step is recorded at: powers of two below ``largest``, and ``largest`` (and every count
    up to ``every``: a verify step's few rows, where a padded row costs as much as a drafted one). A step
    runs the smallest that holds its rows, so one request decodes in a one-row step and a short prompt
    runs in a short mixed step (vLLM captures its CUDA graphs at a like ladder of batch sizes)."""
    powers = {1 << i for i in range(largest.bit_length()) if 1 << i < largest}
    return sorted(powers | {largest} | set(range(1, min(every, largest) + 1)))


def default_step_tokens(device: Device, max_batch: int) -> int:
    """An engine's token budget per step when not given: 2,048 rows on a device that computes while the host
    goes on (a GPU: vLLM's default for online serving), 256 on the CPU devices (numpy, lavapipe: there a
    step's rows cost the host its time, and a smaller step keeps the decoding sequences' latency down while
    prompts run); at least twice ``max_batch``, so that prompts keep half a step when every slot decodes."""
    return max(2 * max_batch, 2048 if device.executor.concurrent else 256)


@dataclass
class ChunkLogprobs:
    """What a step read back of one chunk's logprobs: its sampled token's (None: not asked) and, for a
    prompt piece whose sequence asked, one per row: the logprob of the prompt token after that row (the
    rows before the prompt's last)."""

    sampled: list[TokenLogprob] | None = None  # one per sampled token (a verify step's chunk: per row)
    prompt: list[TokenLogprob] | None = None


@dataclass
class Submitted:
    """A plan's step, submitted: ``next_ids[token_rows[i]]`` is the token of ``plan.chunks[i]`` (a verify
    step's chunk samples ``next_ids[samples[i]]``, one per row; other chunks one, ``token_rows[i]``); the
    step's ``logprobs`` rows likewise, and (a scoring step's) ``prompt_rows[i]`` the rows of chunk ``i`` in
    ``prompt_logprobs``. A split step is ``pending`` until :meth:`StepRunner.sample` submits its sampling
    part. ``logprobs``: whether any of the step's samples computes token logprobs (False: none asked)."""

    plan: StepPlan
    submission: Submission
    step: Step
    token_rows: list[int]
    prompt_rows: list[range]
    pending: bool = False  # a split step whose sampling part is not submitted yet
    samples: list[range] | None = None  # per chunk, its samples (None: one each, its token row)
    logprobs: bool = True

    @property
    def sample_rows(self) -> list[range]:
        """Each chunk's samples (rows of ``next_ids`` and ``logprobs``)."""
        if self.samples is None:
            return [range(row, row + 1) for row in self.token_rows]
        return self.samples

    async def read_async(self) -> list[list[int]]:
        """The step's tokens for each chunk of its plan (one, or a verify step's one per row; awaits the
        device)."""
        ids = await self.submission.read_async(self.step.next_ids)
        if self.samples is None:  # one token per chunk: one gather
            return [[token] for token in ids[self.token_rows].tolist()]
        return [ids[rows].tolist() for rows in self.samples]

    async def logprobs_async(self, tokens: list[list[int]]) -> list[ChunkLogprobs] | None:
        """Per chunk, the logprobs its sequence asked for (of its sampled tokens, ``tokens[i]``, and of its
        prompt's tokens); None when no chunk asked: then nothing more is read. Reads only the small rows of
        the ``logprobs`` op."""
        chunks, scoring = self.plan.chunks, self.step.prompt_logprobs is not None
        if not self.logprobs and not scoring:
            return None
        sampled = [c.sampled and c.sequence.params.logprobs is not None for c in chunks]
        prompt = [scoring and wants_prompt_logprobs(c) for c in chunks]
        if not any(sampled) and not any(prompt):
            return None
        rows = await self.submission.read_async(self.step.logprobs) if any(sampled) else None
        lines = None
        if any(prompt):
            assert self.step.prompt_logprobs is not None
            lines = await self.submission.read_async(self.step.prompt_logprobs)
        result, samples = [], self.sample_rows
        for index, chunk in enumerate(chunks):
            entry = ChunkLogprobs()
            if rows is not None and sampled[index]:
                entry.sampled = [token_logprob(rows[r], t) for r, t in zip(samples[index], tokens[index])]
            if lines is not None and prompt[index]:
                following = chunk.sequence.prompt[chunk.start + 1 : chunk.start + chunk.count + 1]
                entry.prompt = [token_logprob(lines[row], t) for row, t in zip(self.prompt_rows[index], following)]
            result.append(entry)
        return result


class StepRunner:
    """An engine's recorded steps, decode and mixed, each at the row counts :func:`step_sizes` up to
    ``max_batch`` and ``max_step_tokens`` (a mixed step samples for at most ``max_batch`` chunks; in the
    ``max_batch`` decode step sample ``i`` is slot ``i``'s), the slots' persistent rows
    (:class:`~batchgpu.llm.feeds.SlotTable`), and how a :class:`StepPlan` runs on them: in the smallest step
    of its kind that holds its rows, with feeds packed from the plan. ``runs``: steps run so far per kind
    and row count."""

    def __init__(
        self,
        device: Device,
        config: LlamaConfig,
        weights: dict[str, Tensor],
        cache: KVCache,
        *,
        max_batch: int,
        max_step_tokens: int,
        max_blocks: int,
        scoring_rows: int = SCORING_ROWS,
        verify: tuple[int, int] = (0, 0),
        greedy: bool = False,
    ) -> None:
        self.device, self.cache, self.max_batch, self.scoring_rows = device, cache, max_batch, scoring_rows
        self.table = SlotTable(max_batch, max_blocks, cache.block_size, greedy)
        record = functools.partial(
            record_step, device, config, weights, cache, max_blocks=max_blocks, store_rows=max(max_batch, verify[0])
        )
        self.record = record
        self.recorded = {
            StepKind.DECODE: self.ladder(record, StepKind.DECODE, max_batch),
            StepKind.MIXED: self.ladder(record, StepKind.MIXED, max_step_tokens),
        }
        if verify[0]:  # speculative decoding's verify steps: the most rows, and rows counted one by one
            self.recorded[StepKind.VERIFY] = self.ladder(record, StepKind.VERIFY, *verify)
        self.putter: tuple[GpuCommandBatch, Tensor, Tensor] | None = None  # put_tokens' batch: on first use
        self.variants: dict[tuple[StepKind, int, bool, bool], Step] = {}  # scoring or masked: on first use
        self.runs = {kind: dict.fromkeys(steps, 0) for kind, steps in self.recorded.items()}

    def ladder(self, record: Callable[..., Step], kind: StepKind, largest: int, every: int = 0) -> dict[int, Step]:
        """Steps of ``kind`` recorded at each row count of :func:`step_sizes` (``largest``, ``every``)."""
        return {size: self.record_size(record, kind, size) for size in step_sizes(largest, every)}

    def record_size(
        self, record: Callable[..., Step], kind: StepKind, size: int, scoring: bool = False, masked: bool = False
    ) -> Step:
        """The step of ``kind`` at ``size`` rows (``scoring``: a mixed step giving the logprobs of the prompt rows
        of pieces that ask, at most ``scoring_rows`` of them; ``masked``: with the samples' allowed-token
        bitmasks, split, so that its masks, which need the tokens before, are filled while its forward part
        runs)."""
        mixed = kind is not StepKind.DECODE  # a verify step's rows read their tokens from the host, as prompts'
        samples = size if kind is StepKind.VERIFY else min(self.max_batch, size)  # a verify step: every row
        label = ("score" if scoring else kind.value) + ("-masked" if masked else "")
        return record(
            rows=size, samples=samples, table_rows=min(self.max_batch, size), name=f"{label}{size}", mixed=mixed,
            by_slot=not mixed and samples == self.max_batch, scoring=min(size, self.scoring_rows) if scoring else 0,
            masked=masked, split=masked,
        )  # fmt: skip

    def step_for(self, plan: StepPlan, size: int) -> Step:
        """The recorded step of ``size`` rows that runs ``plan``: a scoring step where a prompt piece of the
        plan asks for its prompt's logprobs, a masked one where a chunk samples with a grammar (each variant
        recorded the first time one is needed)."""
        scoring = plan.kind is StepKind.MIXED and any(wants_prompt_logprobs(c) for c in plan.chunks)
        masked = any(guided(c) for c in plan.chunks)
        if not scoring and not masked:
            return self.recorded[plan.kind][size]
        key = (plan.kind, size, scoring, masked)
        if key not in self.variants:
            self.variants[key] = self.record_size(self.record, plan.kind, size, scoring=scoring, masked=masked)
        return self.variants[key]

    def run(self, plan: StepPlan) -> Submitted:
        """Pack ``plan`` into the smallest recorded step of its kind that holds its rows and submit it."""
        size = next(size for size in self.recorded[plan.kind] if size >= plan.rows)
        step = self.step_for(plan, size)
        samples: list[range] | None = None
        if plan.kind is StepKind.MIXED:
            token_rows = list(range(len(plan.chunks)))
            pack_mixed(step.feeds, self.table, plan.chunks)
        elif plan.kind is StepKind.VERIFY:
            samples = pack_verify(step.feeds, self.table, plan.chunks)
            token_rows = [rows.start for rows in samples]
        else:
            by_slot = size == self.max_batch
            token_rows = [c.sequence.slot for c in plan.chunks] if by_slot else list(range(len(plan.chunks)))
            pack_decode(step.feeds, self.table, plan.chunks, token_rows)
        submission = step.run_packed()
        self.runs[plan.kind][size] += 1
        prompt_rows = piece_rows(plan) if step.prompt_logprobs is not None else []
        logprobs = bool((self.table.logprob_n >= 0).any())  # a slot's sequence asks (those of this step among them)
        return Submitted(plan, submission, step, token_rows, prompt_rows, step.forward is not None, samples, logprobs)

    def put_tokens(self, slots: list[int], tokens: list[int]) -> None:
        """Write ``tokens[i]`` as slot ``slots[i]``'s latest token on the device, where the next decode row
        reads it (after a verify step: the last accepted token, not the last row's sample); submitted, as
        every step is, in order."""
        if self.putter is None:
            batch = GpuCommandBatch(self.device, name="put-tokens")
            rows = batch.upload(np.zeros(self.max_batch, np.int32), name="slots")
            values = batch.upload(np.zeros((self.max_batch, 1), np.int32), name="tokens")
            batch.scatter_rows(self.cache.tokens, rows, values)
            self.putter = (batch, rows, values)
        batch, rows, values = self.putter
        feed_rows, feed_values = np.full(self.max_batch, -1, np.int32), np.zeros((self.max_batch, 1), np.int32)
        feed_rows[: len(slots)], feed_values[: len(slots), 0] = slots, tokens
        batch.execute({rows: feed_rows, values: feed_values})

    def sample(self, submitted: Submitted) -> Submitted:
        """Submit a split step's sampling part, with its grammar rows' masks (their guides must have taken
        every token before this step: read the steps before it first); returns ``submitted``."""
        assert submitted.pending, "sample: the step is not split or its sampling part already runs"
        step = submitted.step
        pack_masks(step.feeds.arrays, submitted.plan.chunks, submitted.sample_rows)
        submitted.submission = step.sample_packed()
        submitted.pending = False
        return submitted


def piece_rows(plan: StepPlan) -> list[range]:
    """The rows of each chunk of a scoring step's ``plan`` among its scored rows (the scored pieces' rows,
    back to back in chunk order: :func:`~batchgpu.llm.feeds.pack_mixed`); none for the others."""
    rows, start = [], 0
    for chunk in plan.chunks:
        count = chunk.count if wants_prompt_logprobs(chunk) else 0
        rows.append(range(start, start + count))
        start += count
    return rows
