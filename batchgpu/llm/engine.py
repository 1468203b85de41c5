"""The LLM engine: many concurrent generations served through one recorded decode step.

Requests wait in a queue; a request joins when a slot and the KV blocks for its prompt and output are
free (continuous batching: between any two steps), runs its prompt through the recorded prefill step in
fixed-size chunks, then takes part in the recorded decode step, which serves every decoding slot at once
(up to ``max_batch``), and leaves at once when it ends (end-of-sequence, a stop string, ``max_tokens``,
cancellation), freeing its slot and blocks. Prefill chunks and decode steps alternate, so a long prompt
does not stall the others. Sampling happens on the device; only the sampled ids come back.

The scheduler is plain Python over small arrays, run as one asyncio task per event loop; ``generate``
may be called from many tasks of that loop, ``generate_sync``/``complete`` from synchronous code. Large
prompts are tokenized (and chat templates rendered) on a thread of the engine's own, one prompt at a time,
so they do not stall the loop that streams the other requests' tokens; small ones at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..batch import Submission, default_device
from ..device import Device
from ..errors import BatchError, RequestError
from ..models.llama import loading, open_weights, smollm2_path, steps_ahead, upload_weights
from ..tensor import Tensor
from .blocks import BlockPool
from .params import SamplingParams
from .step import KVCache, Step, record_step
from .text import TextStream

Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]
"""A text prompt, token ids, or chat messages (``[{"role": "user", "content": "..."}]``)."""

INLINE_PROMPT = 2048
"""Prompts up to this size (:func:`prompt_size`) are tokenized on the event loop (a millisecond or two);
larger ones on the engine's tokenizing thread."""


def prompt_size(prompt: Any) -> int:
    """The characters of a text prompt or of chat messages' strings, or the count of token ids."""
    if isinstance(prompt, str):
        return len(prompt)
    if not isinstance(prompt, (list, tuple, np.ndarray)):
        return 0
    strings = (v for m in prompt if isinstance(m, Mapping) for v in m.values() if isinstance(v, str))
    return len(prompt) + sum(len(s) for s in strings)


@dataclass
class Piece:
    """Part of a generation's output: new text and token ids, and on the last piece why it ended
    (``finish_reason``: ``"stop"``, ``"length"`` or ``"cancelled"``) and the token counts."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(eq=False)
class Request:
    """One generation's state in the engine."""

    id: int
    prompt: list[int]
    params: SamplingParams
    stream: TextStream
    seed: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    slot: int = -1
    blocks: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens submitted to run
    sampled: int = 0  # tokens a submitted step samples for it (read back or not yet)
    output: list[int] = field(default_factory=list)
    cancelled: bool = False
    done: bool = False
    created: float = field(default_factory=time.perf_counter)

    @property
    def length(self) -> int:
        """Tokens in the KV cache once the submitted steps ran (the prompt rows, then every sampled token
        but the newest): the position of the next decode step's row."""
        return self.prefilled + max(self.sampled - 1, 0)

    @property
    def decoding(self) -> bool:
        """Its prompt ran and it needs more tokens than the submitted steps sample."""
        return self.prefilled == len(self.prompt) and self.sampled < self.params.max_tokens


@dataclass
class Pending:
    """A submitted step whose sampled ids are not read yet: ``requests[i]``'s token is ``next_ids[rows[i]]``,
    a real one where ``sampled[i]`` (not a prompt chunk that leaves more of its prompt to run)."""

    kind: str
    requests: list[Request]
    submission: Submission
    next_ids: Tensor
    rows: list[int]
    sampled: list[bool]


def step_sizes(largest: int) -> list[int]:
    """The row counts a step is recorded at: powers of two below ``largest``, and ``largest``. A step
    runs the smallest that holds its rows, so one request decodes in a one-row step and a short prompt
    runs in a short prefill step (vLLM captures its CUDA graphs at a like ladder of batch sizes)."""
    return sorted({1 << i for i in range(largest.bit_length()) if 1 << i < largest} | {largest})


def smallest_fitting(steps: Mapping[int, Step], rows: int) -> int:
    """The smallest recorded row count of ``steps`` (ascending keys) that holds ``rows`` rows."""
    return next(size for size in steps if size >= rows)


class Engine:
    """Serve generations of a Llama-family model (a GGUF file or a Hugging Face directory) on one device.

    ``max_batch`` slots decode together; ``max_context`` bounds prompt + output tokens (at most the
    model's trained length); the paged KV cache holds ``kv_blocks`` blocks of ``block_size`` tokens
    (default: room for every slot at a quarter of ``max_context``, at least one full context), in
    ``kv_dtype`` (float32 or float16); prompts run in chunks of ``prefill_chunk`` tokens. ``fuse``
    concatenates each layer's q/k/v weights: one GEMV, then rope and both KV pool writes in one kernel
    (False: the separate ops, the same numbers). Each step's sampled tokens stay on the device as the next
    decode step's input, so up to ``ahead`` steps are submitted before the oldest one's tokens are read
    (0: every step waits for the previous one's read; default: :func:`~batchgpu.models.llama.steps_ahead`);
    a request that stops early drops what ran past it.
    """

    _ids = itertools.count()

    def __init__(
        self,
        model: str | Path | None = None,
        device: Device | None = None,
        *,
        max_batch: int = 8,
        max_context: int = 2048,
        quantized: bool = True,
        kv_dtype: Any = np.float32,
        block_size: int = 16,
        kv_blocks: int | None = None,
        prefill_chunk: int = 32,
        fuse: bool = True,
        ahead: int | None = None,
    ) -> None:
        self.device = device if device is not None else default_device()
        self.path = Path(model) if model is not None else smollm2_path()
        if max_batch < 1 or prefill_chunk < 1:
            raise BatchError("Engine: max_batch and prefill_chunk must be at least 1")
        self.ahead = steps_ahead(self.device, ahead, "Engine")
        with loading(self.path) as stages:  # one display over reading the file and uploading the weights
            weights = open_weights(self.path)
            self.config = weights.config
            self.codec = weights.codec()
            trained = self.config.context or max_context
            if not 1 <= max_context <= trained:
                raise BatchError(f"Engine: max_context must be in [1, {trained}] (the model's trained length)")
            self.config.check_context(max_context, "Engine")
            self.weights = upload_weights(self.device, weights, quantized=quantized, fuse=fuse, stages=stages)
        self.max_batch, self.max_context, self.prefill_chunk = max_batch, max_context, prefill_chunk
        self.max_blocks = -(-max_context // block_size)
        blocks = kv_blocks if kv_blocks is not None else max(self.max_blocks, max_batch * self.max_blocks // 4)
        self.pool = BlockPool(blocks, block_size)
        self.cache = KVCache.allocate(
            self.device, self.config, blocks=blocks, block_size=block_size, slots=max_batch, dtype=np.dtype(kv_dtype)
        )
        self.decode_steps = {
            size: self._record(rows=size, samples=size, name=f"decode{size}") for size in step_sizes(max_batch)
        }
        self.prefill_steps = {
            size: self._record(rows=size, samples=min(max_batch, size), name=f"prefill{size}", prompt=True)
            for size in step_sizes(prefill_chunk)
        }
        self.waiting: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * max_batch
        self.steps = {"prefill": 0, "decode": 0}
        self.decode_sizes = dict.fromkeys(self.decode_steps, 0)  # decode steps run per recorded batch size
        self.prefill_sizes = dict.fromkeys(self.prefill_steps, 0)  # prefill steps run per recorded row count
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._prefill_turn = True
        # one thread: a prompt's tokenizer memory (about 150 bytes per character) is held once at a time
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchgpu-tokenize")

    def _record(self, *, rows: int, samples: int, name: str, prompt: bool = False) -> Step:
        """Record a step; in the ``max_batch`` decode step sample ``i`` is slot ``i``'s."""
        return record_step(
            self.device,
            self.config,
            self.weights,
            self.cache,
            rows=rows,
            samples=samples,
            table_rows=samples,
            max_blocks=self.max_blocks,
            name=name,
            prompt=prompt,
            by_slot=not prompt and samples == self.max_batch,
        )

    # the public API -------------------------------------------------------------------------------------

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, *, trusted: bool = False
    ) -> AsyncIterator[Piece]:
        """Stream the generation of ``prompt`` as :class:`Piece` s. Usable from many tasks at once;
        stopping the iteration (or cancelling the task) cancels the request and frees its slot. Chat
        messages get control tokens from the chat template alone (text in them that spells one is plain
        text, :meth:`batchgpu.llm.text.TextCodec.encode_chat`); ``trusted``: the
        messages' control-token text is control too. A text prompt is the caller's whole prompt: control
        tokens wherever their text appears."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}", "params")
        if prompt_size(prompt) <= INLINE_PROMPT:
            ids = self._prompt_ids(prompt, trusted)  # quicker than a hop to the thread
        else:
            ids = await asyncio.get_running_loop().run_in_executor(self._tokenizing, self._prompt_ids, prompt, trusted)
        request = self._request(ids, params)
        self._start()
        self.waiting.append(request)
        assert self._wake is not None
        self._wake.set()
        try:
            while True:
                item = await request.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not request.done:
                request.cancelled = True
                if self._wake is not None:
                    self._wake.set()

    def generate_sync(
        self, prompt: Prompt, params: SamplingParams | None = None, *, trusted: bool = False
    ) -> Iterator[Piece]:
        """:meth:`generate` for synchronous code (runs the engine on a private event loop meanwhile)."""
        loop = asyncio.new_event_loop()
        stream = self.generate(prompt, params, trusted=trusted)
        try:
            while True:
                try:
                    yield loop.run_until_complete(stream.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            loop.run_until_complete(stream.aclose())
            self._stop(loop)
            loop.close()

    def complete(self, prompt: Prompt, params: SamplingParams | None = None, *, trusted: bool = False) -> Piece:
        """The whole generation as one :class:`Piece` (synchronous)."""
        text, ids, last = [], [], Piece("", [])
        for piece in self.generate_sync(prompt, params, trusted=trusted):
            text.append(piece.text)
            ids += piece.token_ids
            last = piece
        return Piece("".join(text), ids, last.finish_reason, last.prompt_tokens, last.completion_tokens)

    def memory(self) -> dict[str, Any]:
        """The paged KV cache (blocks in use and free, block size, bytes of the pools) and the weights'
        device bytes per storage format (``weight_bytes``: block formats by name, float tensors by dtype)."""
        weight_bytes: dict[str, int] = {}
        for tensor in self.weights.values():
            kind = getattr(tensor, "qtype", None) or tensor.dtype.name
            weight_bytes[kind] = weight_bytes.get(kind, 0) + tensor.storage.nbytes
        return {
            "blocks_used": self.pool.used,
            "blocks_free": self.pool.free,
            "blocks": self.pool.blocks,
            "block_size": self.pool.block_size,
            "kv_bytes": self.cache.nbytes,
            "weight_bytes": weight_bytes,
        }

    @property
    def failure(self) -> BaseException | None:
        """The error that ended the scheduler task, if one did (a health check's question)."""
        task = self._task
        if task is None or not task.done() or task.cancelled():
            return None
        return task.exception()

    def status(self) -> dict[str, Any]:
        """Requests running (holding a slot) and waiting, steps run so far (also per recorded row count),
        and :meth:`memory`."""
        return {
            "running": sum(slot is not None for slot in self.slots),
            "waiting": len(self.waiting),
            "steps": dict(self.steps),
            "decode_sizes": dict(self.decode_sizes),
            "prefill_sizes": dict(self.prefill_sizes),
            "memory": self.memory(),
        }

    # requests ------------------------------------------------------------------------------------------

    def _request(self, ids: list[int], params: SamplingParams) -> Request:
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        if len(ids) + params.max_tokens > self.max_context:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceed the engine's max_context "
                f"({self.max_context})",
                "prompt",
            )
        if self.pool.needed(len(ids) + params.max_tokens) > self.pool.blocks:
            raise RequestError(
                f"the request needs {self.pool.needed(len(ids) + params.max_tokens)} KV blocks; the cache has "
                f"{self.pool.blocks}",
                "max_tokens",
            )
        seed = params.seed if params.seed is not None else random.getrandbits(32)
        return Request(next(self._ids), ids, params, TextStream(self.codec, params.stop), seed)

    def _prompt_ids(self, prompt: Prompt, trusted: bool) -> list[int]:
        """The prompt's token ids (run on the tokenizing thread)."""
        if isinstance(prompt, str):
            return self.codec.encode(prompt)
        items = list(prompt) if isinstance(prompt, (list, tuple, np.ndarray)) else None
        if items and all(isinstance(m, Mapping) for m in items):
            return self.codec.encode_chat(items, trusted=trusted)
        if items is not None and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in items):
            bad = [t for t in items if not 0 <= t < self.config.vocab]
            if bad:
                raise RequestError(f"prompt token ids out of [0, {self.config.vocab}): {bad[:5]}", "prompt")
            return [int(t) for t in items]
        raise RequestError(
            f"prompt must be a str, a list of token ids or a list of chat messages, got {type(prompt).__name__}",
            "prompt",
        )

    # the scheduler -------------------------------------------------------------------------------------

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run())

    def _stop(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._task is not None and self._task.get_loop() is loop:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                loop.run_until_complete(self._task)
            self._task = None

    async def _run(self) -> None:
        """The scheduler task: :meth:`_schedule`; an error that ends it fails every request it holds (which
        would otherwise wait forever) and the next request starts a new task."""
        try:
            await self._schedule()
        except Exception as exc:
            error = exc if isinstance(exc, BatchError) else BatchError(f"the engine's scheduler failed: {exc!r}")
            for request in [*self.waiting, *(r for r in self.slots if r is not None)]:
                if not request.done:
                    self._finish(request, error)
            self.waiting.clear()
            raise

    async def _schedule(self) -> None:
        """Submit steps while fewer than ``ahead + 1`` are in flight, then read the oldest and deliver its
        tokens; wait when there is nothing to run."""
        assert self._wake is not None
        in_flight: deque[Pending] = deque()
        while True:
            self._drop_cancelled()
            self._admit()
            if len(in_flight) <= self.ahead:
                step = self._next_step()
                if step is not None:
                    pending = self._submit(*step)
                    if pending is not None:
                        in_flight.append(pending)
                    continue
            if not in_flight:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._complete(in_flight.popleft())
            await asyncio.sleep(0)  # let consumers take their pieces between steps

    def _submit(self, kind: str, requests: list[Request]) -> Pending | None:
        try:
            return self._prefill(requests) if kind == "prefill" else self._decode(requests)
        except Exception as exc:  # the device or the feeds failed: every request in the step fails, the engine goes on
            error = exc if isinstance(exc, BatchError) else BatchError(f"the {kind} step failed: {exc!r}")
            for request in requests:
                self._finish(request, error)
            return None

    async def _complete(self, pending: Pending) -> None:
        try:
            ids = await pending.submission.read_async(pending.next_ids)
        except BatchError as exc:
            for request in pending.requests:
                if not request.done:
                    self._finish(request, exc)
            return
        for request, row, sampled in zip(pending.requests, pending.rows, pending.sampled):
            if sampled and not (request.cancelled or request.done):  # done: stopped at an earlier step
                request.output.append(int(ids[row]))
                self._emit(request, int(ids[row]))

    def _drop_cancelled(self) -> None:
        for request in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(request)
            request.done = True
        for request in self.slots:
            if request is not None and request.cancelled:
                self._leave(request)

    def _admit(self) -> None:
        """Waiting requests take free slots while the KV cache can hold their whole generation."""
        while self.waiting and None in self.slots:
            request = self.waiting[0]
            if not self.pool.grow(request.blocks, len(request.prompt) + request.params.max_tokens):
                return  # the oldest request waits for blocks (it fits an empty cache: checked when made)
            self.waiting.popleft()
            request.slot = self.slots.index(None)
            self.slots[request.slot] = request

    def _next_step(self) -> tuple[str, list[Request]] | None:
        active = [r for r in self.slots if r is not None]
        prefilling = [r for r in active if r.prefilled < len(r.prompt)]
        decoding = [r for r in active if r.decoding]
        if prefilling and (self._prefill_turn or not decoding):
            self._prefill_turn = False
            return "prefill", self._prefill_group(prefilling)
        self._prefill_turn = True
        return ("decode", decoding) if decoding else None

    def _prefill_group(self, prefilling: list[Request]) -> list[Request]:
        """The prompts the next prefill step serves: in order, while rows are left (the last one may get
        only part of what is left of its prompt), at most the step's samples."""
        largest = self.prefill_steps[self.prefill_chunk]
        group, rows = [], largest.rows
        for request in prefilling[: largest.samples]:
            if rows <= 0:
                break
            group.append(request)
            rows -= len(request.prompt) - request.prefilled
        return group

    # steps ---------------------------------------------------------------------------------------------

    def _prefill(self, requests: list[Request]) -> Pending:
        """One prefill step: the next pieces of ``requests``' prompts packed into at most ``prefill_chunk``
        rows (see :meth:`_prefill_group`), each a contiguous run of rows, in the smallest recorded step that
        holds them; request ``i`` samples from its last row (kept only where its piece ends its prompt)."""
        pieces, start = [], 0
        for request in requests:
            n = min(len(request.prompt) - request.prefilled, self.prefill_chunk - start)
            pieces.append(n)
            start += n
        size = smallest_fitting(self.prefill_steps, start)
        step = self.prefill_steps[size]
        feeds = self._empty_feeds(step)
        start = 0
        for index, (request, n) in enumerate(zip(requests, pieces)):
            first = request.prefilled
            rows = slice(start, start + n)
            positions = np.arange(first, first + n, dtype=np.int32)
            feeds["ids"][rows] = request.prompt[first : first + n]
            feeds["positions"][rows] = positions
            feeds["kv_rows"][rows] = [self.pool.row(request.blocks, int(q)) for q in positions]
            feeds["seq"][rows] = index
            feeds["lengths"][rows] = positions + 1
            feeds["block_tables"][index, : len(request.blocks)] = request.blocks
            feeds["count_slots"][rows] = request.slot
            if first == 0:
                feeds["reset"][request.slot] = 1
            self._sampling_row(feeds, index, request, row=start + n - 1)
            feeds["sampled_slots"][index] = request.slot if first + n == len(request.prompt) else -1
            start += n
        submission = step.run(feeds)
        ends = [r.prefilled + n == len(r.prompt) for r, n in zip(requests, pieces)]
        for request, n, end in zip(requests, pieces, ends):
            request.prefilled += n
            request.sampled += end
        self.steps["prefill"] += 1
        self.prefill_sizes[size] += 1
        return Pending("prefill", requests, submission, step.next_ids, list(range(len(requests))), ends)

    def _decode(self, requests: list[Request]) -> Pending:
        """One decode step over the smallest recorded batch size that holds ``requests``: row ``i`` serves
        ``requests[i]`` (in the ``max_batch`` step, row ``r.slot`` serves ``r``, as its counts rows do)."""
        size = smallest_fitting(self.decode_steps, len(requests))
        step = self.decode_steps[size]
        rows = [r.slot for r in requests] if size == self.max_batch else list(range(len(requests)))
        feeds = self._empty_feeds(step)
        for row, request in zip(rows, requests):
            position = request.length
            feeds["token_slots"][row] = request.slot  # its latest token, where the step before left it
            feeds["positions"][row] = position
            feeds["kv_rows"][row] = self.pool.row(request.blocks, position)
            feeds["seq"][row] = row
            feeds["lengths"][row] = position + 1
            feeds["block_tables"][row, : len(request.blocks)] = request.blocks
            self._sampling_row(feeds, row, request, row=row)
            feeds["sampled_slots"][row] = request.slot
        submission = step.run(feeds)
        for request in requests:
            request.sampled += 1
        self.steps["decode"] += 1
        self.decode_sizes[size] += 1
        return Pending("decode", requests, submission, step.next_ids, rows, [True] * len(requests))

    def _empty_feeds(self, step: Step) -> dict[str, np.ndarray]:
        """Every input of ``step`` as an idle step: no rows written, attended or counted."""
        feeds = {name: np.zeros(t.shape, t.dtype) for name, t in step.inputs.items()}
        for name in ("kv_rows", "count_slots", "sampled_slots"):
            if name in feeds:
                feeds[name][:] = -1
        feeds["sampling"][:, 1] = 1.0  # top_p off
        feeds["penalties"][:, 0] = 1.0  # repetition penalty off
        return feeds

    def _sampling_row(self, feeds: dict[str, np.ndarray], index: int, request: Request, *, row: int) -> None:
        params = request.params
        feeds["sample_rows"][index] = row
        feeds["sample_slots"][index] = request.slot
        feeds["penalties"][index] = (params.repetition_penalty, params.presence_penalty, params.frequency_penalty)
        feeds["sampling"][index] = (params.temperature, params.top_p, params.min_p, 0.0)
        feeds["top_k"][index] = params.top_k
        feeds["keys"][index] = (request.seed, request.sampled)

    # results -------------------------------------------------------------------------------------------

    def _emit(self, request: Request, token: int) -> None:
        params = request.params
        eos = not params.ignore_eos and token in self.codec.eos_ids
        stop_token = token in params.stop_token_ids
        delta = request.stream.push(token) if not (eos or stop_token) else request.stream.finish()
        reason = None
        if eos or stop_token or delta.stopped:
            reason = "stop"
        elif len(request.output) >= params.max_tokens:
            tail = request.stream.finish()  # the text held back, up to a stop string it completes
            delta.text += tail.text
            reason = "stop" if tail.stopped else "length"
        piece = Piece(delta.text, [token])
        if reason is not None:
            piece.finish_reason = reason
            piece.prompt_tokens, piece.completion_tokens = len(request.prompt), len(request.output)
            self._leave(request)
        request.queue.put_nowait(piece)

    def _finish(self, request: Request, error: BaseException) -> None:
        self._leave(request)
        request.queue.put_nowait(error)

    def _leave(self, request: Request) -> None:
        """The request ends: its slot and blocks are free for the next step."""
        request.done = True
        if request.slot >= 0 and self.slots[request.slot] is request:
            self.slots[request.slot] = None
        self.pool.release(request.blocks)
        request.slot = -1
