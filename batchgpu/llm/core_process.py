"""The engine's core in a process of its own (vLLM v1's ``EngineCore`` process): :func:`run_core` makes the
engine, then serves its client's messages on an event loop where the engine's step loop runs. Each sequence
hands its tokens to a :class:`~batchgpu.llm.core_output.CoreOutput` rather than to an output processor,
and each step's tokens go to the client in one message: detokenization, stop strings and each request's
hand-over to its caller run in the client's process, beside the core's steps rather than between them
(:class:`~batchgpu.llm.engine_process.EngineProcess`).

Messages from the client (tuples over a :mod:`multiprocessing` pipe):

- ``("add", request, ids, params)``: queue a request's samples (its grammar, if any, compiled on a thread
  first); answered by the item ``(request, None, None)``, or ``(request, None, error)`` where it is refused;
- ``("end", request, index)``: cancel sample ``index`` (None: every sample; the request is forgotten);
- ``("call", call, payload)``: ``function(engine, *args)`` where the payload is the pickled ``(function,
  args)``, answered ``("reply", call, result, error)`` (status, memory, and the benchmarks' clocks);
- ``("close",)``: stop (so does the client's end of the pipe closing).

To the client: ``("ready", facts)`` or ``("failed", error)`` once, then ``("out", items, counts)`` per step
(:data:`~batchgpu.llm.core_output.Item`; ``counts``: :class:`CoreCounts`) and the replies."""

from __future__ import annotations

import asyncio
import gc
import pickle
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from ..errors import BatchError
from .core_output import CoreOutput, Outbox
from .engine import Engine
from .metrics import Histogram, Load
from .options import EngineOptions
from .params import SamplingParams
from .prompt import request_guides
from .scheduler import Sequence


@dataclass
class CoreCounts:
    """What the core's metrics say after a step: its load, steps run per kind and token rows per step."""

    load: Load
    steps: dict[str, int]
    iteration_tokens: Histogram


def portable(error: BaseException) -> BaseException:
    """``error`` where it survives pickling, else a BatchError that names it."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return BatchError(f"{type(error).__name__}: {error}")
    return error


def run_core(conn: Connection, options: EngineOptions) -> None:
    """The core process: make the engine of ``options`` and say it is ready (or why not), then serve the
    client's messages until it closes or leaves. Ctrl-C is the client's to handle (its process group gets it
    too): the core ends with its pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = options.make()
    except BaseException as exc:
        conn.send(("failed", portable(exc)))
        return
    facts = {"config": engine.config, "path": str(engine.path), "max_context": engine.max_context}
    facts |= {"block_size": engine.pool.block_size, "blocks": engine.pool.blocks}
    conn.send(("ready", {**facts, "max_batch": engine.max_batch, "max_waiting": engine.max_waiting}))
    gc.collect()
    gc.freeze()  # the model's and engine's long-lived objects out of the collector's scans, as batchgpu serve does
    asyncio.run(Core(engine, conn).serve())


class Core:
    """The client's messages served on the running event loop, over ``engine``; ``requests`` holds each
    request's sequences until the client ends it."""

    def __init__(self, engine: Engine, conn: Connection) -> None:
        self.engine, self.conn = engine, conn
        self.requests: dict[int, list[Sequence]] = {}
        self.compiled: dict[int, bool] = {}  # requests whose grammars compile: whether the client ended them meanwhile
        self.outbox = Outbox(conn.send, self.counts)
        self.compiling = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchgpu-grammar")
        self.handlers = {"add": self.add, "end": self.end, "call": self.call, "close": self.close}
        self.closed = asyncio.Event()

    async def serve(self) -> None:
        """Read the client's messages as they come until it closes or leaves."""
        loop = asyncio.get_running_loop()
        loop.add_reader(self.conn.fileno(), self.receive)
        try:
            await self.closed.wait()
        finally:
            loop.remove_reader(self.conn.fileno())
            self.compiling.shutdown(wait=False, cancel_futures=True)

    def receive(self) -> None:
        try:
            while self.conn.poll():
                kind, *arguments = self.conn.recv()
                self.handlers[kind](*arguments)
        except (EOFError, OSError):  # the client is gone
            self.closed.set()

    def counts(self) -> CoreCounts:
        stats = self.engine.stats
        return CoreCounts(self.engine.load(), stats.steps, stats.iteration_tokens)

    # messages ------------------------------------------------------------------------------------------

    def add(self, request: int, ids: list[int], params: SamplingParams) -> None:
        if params.structured is None and params.tools is None:
            self.queue(request, ids, params, None)
        else:
            asyncio.get_running_loop().create_task(self.add_guided(request, ids, params))

    async def add_guided(self, request: int, ids: list[int], params: SamplingParams) -> None:
        """Compile the request's grammar on the core's thread (the steps go on meanwhile), then queue it."""
        engine, loop = self.engine, asyncio.get_running_loop()
        self.compiled[request] = False
        try:
            guides = await loop.run_in_executor(self.compiling, request_guides, engine.codec, params, engine.grammar)
        except Exception as exc:
            self.outbox.put((request, None, portable(exc)))
            return
        finally:
            ended = self.compiled.pop(request)
        if not ended:
            self.queue(request, ids, params, guides)

    def queue(self, request: int, ids: list[int], params: SamplingParams, guides: list[Any] | None) -> None:
        """Queue the request's samples, each handing its tokens to a CoreOutput; the client learns either way."""
        outbox, ends = self.outbox, self.engine.codec.eos_ids

        def output(index: int, sequence: Sequence) -> CoreOutput:
            return CoreOutput(sequence.params, ends, outbox, request, index, sequence.guide)

        try:
            self.requests[request] = self.engine.queue_samples(ids, params, guides, output)
        except Exception as exc:
            outbox.put((request, None, portable(exc)))
            return
        outbox.put((request, None, None))

    def end(self, request: int, index: int | None) -> None:
        if request in self.compiled and index is None:
            self.compiled[request] = True
        sequences = self.requests.pop(request, []) if index is None else self.requests.get(request, [])[index:][:1]
        self.engine.cancel(sequences)

    def call(self, call: int, payload: bytes) -> None:
        try:
            function, arguments = pickle.loads(payload)  # here: a function this process cannot import is an error
            result, error = function(self.engine, *arguments), None
        except Exception as exc:
            result, error = None, portable(exc)
        self.conn.send(("reply", call, result, error))

    def close(self) -> None:
        self.closed.set()
