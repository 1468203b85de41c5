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
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..batch import default_device
from ..device import Device
from ..errors import BatchError
from ..models.llama import load_model, smollm2_path, steps_ahead, weight_bytes
from ..models.speculative import Speculative
from .admission import check_max_waiting
from .blocks import BlockPool, default_blocks
from .draft_model import DraftModel
from .driver import Driver
from .front import Front, Started, engine_places
from .grammar import GrammarEngine, Guide
from .metrics import EngineStats, Load, clock
from .output import Output, OutputProcessor, PieceQueue
from .params import SamplingParams
from .prompt import INLINE_PROMPT, Prompt, prepare, prompt_size
from .samples import add_samples
from .scheduler import Scheduler, StepKind, check_step_tokens
from .scheduler import Sequence as ScheduledSequence
from .speculation import Drafter, PromptLookup, Speculator, check_speculative, verify_rows
from .step import KVCache, StepRunner, default_step_tokens
from .sync_calls import SyncCalls


class Engine(Front, SyncCalls):
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
        self.room = engine_places(max_batch, max_waiting)
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

    def memory(self) -> dict[str, Any]:
        """The paged KV cache (blocks in use and free, ``blocks_cached``: those registered in the prefix
        cache, held or free; block size, bytes of the pools) and the weights' device bytes per storage
        format (``weight_bytes``: block formats by name, float tensors by dtype)."""
        return {**self.pool.usage(), "kv_bytes": self.cache.nbytes, "weight_bytes": weight_bytes(self.weights)}

    @property
    def ahead(self) -> int:
        """Steps submitted before the oldest in flight is read (settable: the next step follows it)."""
        return self.driver.ahead

    @ahead.setter
    def ahead(self, steps: int) -> None:
        self.driver.ahead = steps_ahead(self.device, steps, "Engine")

    @property
    def failure(self) -> BaseException | None:
        """The error that ended the step loop's task, if one did (a health check's question)."""
        return self.driver.failure

    def load(self) -> Load:
        """Sequences running and waiting, the KV blocks' used share and the scheduler's counters (metrics)."""
        return Load.of(self.scheduler, self.pool)

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

    async def start(self, prompt: Prompt, params: SamplingParams, trusted: bool) -> Started:
        """Tokenize ``prompt`` (chat templates rendered, grammars compiled: on the engine's thread for large ones)
        and queue its samples (:meth:`queue_samples`, RequestError where the engine can never serve it)."""
        encode, arrival = (self.codec, self.config.vocab, prompt, trusted, params, self.grammar), clock()
        if prompt_size(prompt) <= INLINE_PROMPT and params.structured is None and params.tools is None:
            ids, guides = prepare(*encode)  # quicker than a hop to the thread
        else:
            ids, guides = await asyncio.get_running_loop().run_in_executor(self._tokenizing, prepare, *encode)
        queue = PieceQueue()

        def output(index: int, sequence: ScheduledSequence) -> OutputProcessor:
            return OutputProcessor(
                self.codec, sequence.params, len(ids), self.stats, arrival, queue=queue, index=index,
                guide=sequence.guide,
            )  # fmt: skip

        sequences = self.queue_samples(ids, params, guides, output)
        return queue, len(sequences), lambda: self.cancel(sequences)

    def queue_samples(
        self, ids: list[int], params: SamplingParams, guides: list[Guide] | None, output: Callable[[int, Any], Output]
    ) -> list[ScheduledSequence]:
        """Queue the samples of a generation of ``ids`` for the step loop (started on this event loop if it does
        not run there; RequestError where the engine can never serve it), sample ``i`` following ``guides[i]``
        and delivering to ``output(i, its sequence)``. Sample ``i`` draws with seed ``seed + i``; the later ones
        share the first's prompt blocks (:meth:`Scheduler.shared_prefix`)."""
        seed = params.seed if params.seed is not None else random.getrandbits(32)
        sequences = add_samples(self.scheduler, ids, params, seed)
        for index, sequence in enumerate(sequences):
            sequence.guide = guides[index] if guides is not None else None
            self.driver.add(sequence, output(index, sequence))
        return sequences

    def cancel(self, sequences: list[ScheduledSequence]) -> None:
        """Cancel those of ``sequences`` that have not ended: their slots and blocks are free at once."""
        if self.driver.end_unfinished(sequences):
            self.driver.wake.set()
