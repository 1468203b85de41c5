"""The LLM engine: its public API (streamed generations, synchronous calls, status) over one device and
model, and how a request enters it: its places counted (:mod:`~batchgpu.llm.admission`), its prompt
tokenized and its samples queued on the scheduler, each with an output processor, for the step loop
(:mod:`~batchgpu.llm.driver`: :mod:`~batchgpu.llm.scheduler` decides each step, continuous batching with
chunked prefill in one token budget and paged KV blocks; :class:`~batchgpu.llm.step.StepRunner` runs it).
Large prompts are tokenized (chat templates rendered) and grammars compiled on a thread of the engine's
own, one at a time, so they do not stall the loop that streams the other requests' tokens; small ones at
once."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..batch import default_device
from ..device import Device
from ..errors import BatchError, OverloadedError, RequestError
from ..models.llama import load_model, smollm2_path, steps_ahead, weight_bytes
from ..models.speculative import Speculative
from .admission import Places, check_max_waiting
from .blocks import BlockPool, default_blocks
from .draft_model import DraftModel
from .driver import Driver
from .grammar import GrammarEngine, Guide
from .metrics import EngineStats, clock
from .output import OutputProcessor, Piece, PieceQueue, Tally
from .params import SamplingParams
from .prompt import INLINE_PROMPT, Prompt, prepare, prompt_size
from .samples import add_samples, request_pieces
from .scheduler import Scheduler, StepKind, check_step_tokens
from .scheduler import Sequence as ScheduledSequence
from .speculation import Drafter, PromptLookup, Speculator, check_speculative, verify_rows
from .step import KVCache, StepRunner, default_step_tokens
from .sync_calls import SyncCalls


class Engine(SyncCalls):
    """Serve generations of a Llama-family model (a GGUF file or a Hugging Face directory) on one device.

    ``max_batch`` slots decode together; ``max_context`` bounds prompt + output tokens (at most the
    model's trained length); the paged KV cache holds ``kv_blocks`` blocks of ``block_size`` tokens
    (default: room for every slot at a quarter of ``max_context``, at least one full context), in
    ``kv_dtype`` (float32 or float16), taken as sequences grow (when none is left, the newest request
    is preempted and recomputed later); full blocks are kept for later prompts with the same prefix
    (``prefix_caching``). Each step carries a row for every sequence ready to decode, then pieces of prompts
    up to ``max_step_tokens`` rows in all (vLLM's ``max_num_batched_tokens``; at least ``max_batch``;
    default: :func:`~batchgpu.llm.step.default_step_tokens`, 2,048 on a GPU, 256 on the CPU devices, and at
    least twice ``max_batch``): a larger budget prefills sooner, a smaller one keeps the decoding sequences'
    steps shorter while prompts run. ``fuse``: one q/k/v GEMV per layer, then rope and both KV writes in one
    kernel (False: separate ops, the same numbers). Sampled
    tokens stay on the device as the next decode step's input, so up to ``ahead`` steps are submitted before
    the oldest one's tokens are read (0: none; default: :func:`~batchgpu.models.llama.steps_ahead`); a
    request that stops early drops what ran past it. A step with grammar rows (structured outputs) is
    split: its sampling part, whose masks need the step before, is submitted once that step is read.

    ``max_waiting`` bounds the requests that wait: the engine holds at most ``max_batch + max_waiting``
    sequences (running, waiting, or being tokenized; a request of ``n`` samples counts ``n``, ``best_of``
    ``best_of``) and refuses a request past that at once with :class:`~batchgpu.errors.OverloadedError`,
    before its prompt is tokenized; a request that ends (finished, failed or cancelled) gives its places
    back. None (the default): unbounded, as an offline batch that queues every prompt it has wants; a
    server facing clients sets a bound (``batchgpu serve`` does, ``--max-waiting``)."""

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
        max_step_tokens: int | None = None,
        fuse: bool = True,
        ahead: int | None = None,
        prefix_caching: bool = True,
        max_waiting: int | None = None,
        speculative: Speculative | None = None,
    ) -> None:
        self.device = device if device is not None else default_device()
        self.path = Path(model) if model is not None else smollm2_path()
        if min(max_batch, block_size, 1 if kv_blocks is None else kv_blocks) < 1:
            raise BatchError(
                f"Engine: max_batch, block_size and kv_blocks must be at least 1, got {max_batch}, {block_size} and "
                f"{kv_blocks}"
            )
        max_step_tokens = default_step_tokens(self.device, max_batch) if max_step_tokens is None else max_step_tokens
        check_step_tokens(max_batch, max_step_tokens)
        check_max_waiting("Engine", max_waiting)
        ahead = steps_ahead(self.device, 0 if speculative is not None and ahead is None else ahead, "Engine")
        check_speculative(speculative, ahead)
        self.config, self.codec, self.weights = load_model(
            self.device, self.path, max_context, quantized=quantized, fuse=fuse, what="Engine"
        )
        self.max_batch, self.max_context, self.max_step_tokens = max_batch, max_context, max_step_tokens
        self.max_waiting = max_waiting
        self.room = Places(
            max_batch, max_waiting, owner="the engine", unit="sequences", states="running, waiting or being tokenized",
            verb="needs", too_many=lambda count, most, bound: RequestError(
                f"{count} samples; this engine holds at most {most} sequences"),
        )  # fmt: skip
        blocks = kv_blocks if kv_blocks is not None else default_blocks(max_batch, max_context, block_size)
        self.pool = BlockPool(blocks, block_size)
        self.scheduler = Scheduler(
            self.pool, max_batch=max_batch, max_context=max_context, max_step_tokens=max_step_tokens,
            prefix_caching=prefix_caching,
        )  # fmt: skip
        self.cache = KVCache.allocate(
            self.device, self.config, blocks=blocks, block_size=block_size, slots=max_batch, dtype=np.dtype(kv_dtype)
        )
        self.runner = StepRunner(
            self.device, self.config, self.weights, self.cache, max_batch=max_batch, max_step_tokens=max_step_tokens,
            max_blocks=self.pool.needed(max_context), scoring_rows=self.scheduler.scoring_rows,
            verify=verify_rows(speculative, max_batch),
        )  # fmt: skip
        self.slots = self.scheduler.slots  # the sequence in each slot (None: free)
        self.stats = EngineStats()  # tokens, steps and latencies so far (the server's /metrics)
        drafter = None if speculative is None else self.drafter(speculative, quantized)
        speculator = None if speculative is None else Speculator(self.scheduler, speculative, drafter)
        self.driver = Driver(self.scheduler, self.runner, self.stats, ahead, speculator)
        self.steps = self.stats.steps  # steps run per kind ("decode", "mixed", "verify")
        self.decode_sizes = self.runner.runs[StepKind.DECODE]  # decode steps run per recorded batch size
        self.mixed_sizes = self.runner.runs[StepKind.MIXED]  # mixed steps run per recorded row count
        # one thread: a prompt's tokenizer memory (about 150 bytes per character) is held once at a time
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchgpu-tokenize")
        self.grammar = GrammarEngine(self.codec, self.config.vocab)  # structured outputs' grammars

    # the public API -------------------------------------------------------------------------------------

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, *, trusted: bool = False
    ) -> AsyncIterator[Piece]:
        """Stream the generation of ``prompt`` as :class:`Piece` s. Usable from many tasks at once; stopping the
        iteration (or cancelling the task) cancels the request and frees its slot. Chat messages get control
        tokens from the chat template alone (text in them that spells one is plain text,
        :meth:`batchgpu.llm.text.TextCodec.encode_chat`); ``trusted``: the messages' control-token text is
        control too. A text prompt is the caller's whole prompt: control tokens wherever their text appears.

        The last piece carries the request's :class:`~batchgpu.llm.output.Usage`, which :attr:`stats` counts as
        that piece goes to the caller; a request that ends otherwise counts by how (:class:`EngineStats`):
        aborted (the caller stopped before its last piece), overloaded, refused (a RequestError before it was
        queued) or failed (an error after)."""
        outcome: str | None = "refused"  # until the request is queued; None once counted
        try:
            params = params if params is not None else SamplingParams()
            if not isinstance(params, SamplingParams):
                raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}", "params")
            with self._places(params):  # OverloadedError before anything is done for the request
                encode, arrival = (self.codec, self.config.vocab, prompt, trusted, params, self.grammar), clock()
                if prompt_size(prompt) <= INLINE_PROMPT and params.structured is None and params.tools is None:
                    ids, guides = prepare(*encode)  # quicker than a hop to the thread
                else:
                    ids, guides = await asyncio.get_running_loop().run_in_executor(self._tokenizing, prepare, *encode)
                sequences, queue = self._add(ids, params, arrival, guides)
                outcome, tally = "aborted", Tally(params.n)  # queued: it finishes, fails or its caller stops
                try:
                    async for piece in request_pieces(queue, len(sequences), params):
                        usage = tally.take(piece)
                        if usage is not None:
                            self.stats.finish(usage.prompt_tokens, usage.completion_tokens, usage.finish_reasons)
                            outcome = None
                        yield piece
                finally:
                    if self.driver.end_unfinished(sequences):  # cancelled: their slots and blocks are free at once
                        self.driver.wake.set()
        except OverloadedError:
            outcome = None  # counted by check_room
            raise
        except (GeneratorExit, asyncio.CancelledError):  # the caller stopped before the last piece
            outcome = "aborted" if outcome is not None else None
            raise
        except Exception as exc:
            if outcome == "aborted" or (outcome == "refused" and not isinstance(exc, RequestError)):
                outcome = "failed"
            raise
        finally:
            if outcome is not None:
                self.stats.end(outcome)

    def memory(self) -> dict[str, Any]:
        """The paged KV cache (blocks in use and free, ``blocks_cached``: those registered in the prefix
        cache, held or free; block size, bytes of the pools) and the weights' device bytes per storage
        format (``weight_bytes``: block formats by name, float tensors by dtype)."""
        return {**self.pool.usage(), "kv_bytes": self.cache.nbytes, "weight_bytes": weight_bytes(self.weights)}

    def check_room(self, samples: int = 1, field: str = "n") -> None:
        """Refuse a request of ``samples`` sequences the engine has no room for now (OverloadedError: it
        holds ``max_batch + max_waiting`` sequences with them) or ever (RequestError naming ``field``: more
        samples than that); nothing where ``max_waiting`` is None. A server asks before it reads a body."""
        try:
            self.room.check(samples)
        except OverloadedError:
            self.stats.overloaded += 1
            raise
        except RequestError as exc:  # more samples than the engine ever holds
            raise RequestError(f"{field}: {exc}", field) from None

    @property
    def ahead(self) -> int:
        """Steps submitted before the oldest in flight is read (settable: the next step follows it)."""
        return self.driver.ahead

    @ahead.setter
    def ahead(self, steps: int) -> None:
        self.driver.ahead = steps_ahead(self.device, steps, "Engine")

    @property
    def held(self) -> int:
        """Sequences of the requests taken and not ended: running, waiting or being tokenized."""
        return self.room.held

    @property
    def failure(self) -> BaseException | None:
        """The error that ended the step loop's task, if one did (a health check's question)."""
        return self.driver.failure

    def status(self) -> dict[str, Any]:
        """Requests running (holding a slot) and waiting, steps run so far (also per recorded row count),
        preemptions and prompt tokens taken from the prefix cache so far, and :meth:`memory`."""
        sizes = {f"{kind.value}_sizes": dict(runs) for kind, runs in self.runner.runs.items()}
        return {**self.scheduler.status(), "steps": dict(self.steps), **sizes, "memory": self.memory()}

    # requests ------------------------------------------------------------------------------------------

    def drafter(self, settings: Speculative, quantized: bool) -> Drafter:
        """The drafter of ``settings``: prompt lookup, or a draft model on this engine's device and KV blocks."""
        if settings.method == "ngram":
            return PromptLookup(settings)
        return DraftModel(
            self.device, settings, vocab=self.config.vocab, max_context=self.max_context, quantized=quantized,
            kv_dtype=self.cache.keys[0].dtype, blocks=self.pool.blocks, block_size=self.pool.block_size,
            max_batch=self.max_batch, max_step_tokens=self.max_step_tokens,
        )  # fmt: skip

    @contextlib.contextmanager
    def _places(self, params: SamplingParams) -> Iterator[None]:
        """Hold a place per sample of a request while it runs (:attr:`held`), refused by :meth:`check_room`."""
        needed = params.samples
        self.check_room(needed, "best_of" if needed > params.n else "n")
        with self.room.hold(needed):
            yield

    def _add(
        self, ids: list[int], params: SamplingParams, arrival: float, guides: list[Guide] | None = None
    ) -> tuple[list[ScheduledSequence], PieceQueue]:
        """Queue the samples of a generation of ``ids`` that arrived at ``arrival`` (RequestError where the
        engine can never serve it), all delivering to one queue, for the step loop (started on this event
        loop if it does not run there). Sample ``i`` draws with seed ``seed + i``; the later ones share the
        first's prompt blocks (:meth:`Scheduler.shared_prefix`); sample ``i`` follows ``guides[i]``."""
        seed = params.seed if params.seed is not None else random.getrandbits(32)
        queue = PieceQueue()
        sequences = add_samples(self.scheduler, ids, params, seed)
        for index, sequence in enumerate(sequences):
            sequence.guide = guides[index] if guides is not None else None
            output = OutputProcessor(
                self.codec, sequence.params, len(ids), self.stats, arrival, queue=queue, index=index,
                guide=sequence.guide,
            )  # fmt: skip
            self.driver.add(sequence, output)
        return sequences, queue
