"""An engine whose core runs in a process of its own (vLLM v1's split of ``AsyncLLM`` and ``EngineCore``):
the core process (:mod:`~batchgpu.llm.core_process`) schedules, runs and reads the steps; this process
tokenizes, turns each step's tokens into text (:class:`~batchgpu.llm.output.OutputProcessor`: stop
strings, logprob bytes, tool calls, latencies) and hands the pieces to their callers. On one thread the
host's per-request work runs between steps; split, it runs beside them, and the core's host time per step
is its scheduling, packing and reading alone. ``batchgpu serve`` serves through it (``--no-engine-process``:
through an :class:`~batchgpu.llm.Engine` in the server's process).

A stop string found here ends the request here at once and in the core at its next message (the core may
have run a step or two past it, which is dropped, as for a request that stops early with steps ahead).
Where the core process dies, every request in flight fails with a BatchError, as does every later one
(:attr:`EngineProcess.failure`)."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import pickle
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..errors import BatchError
from ..models.loader import open_weights
from .core_output import GRAMMAR_END, Item
from .core_process import CoreCounts, run_core
from .front import Front, Started, engine_places
from .metrics import EngineStats, Load, clock
from .options import EngineOptions
from .output import OutputProcessor, PieceQueue
from .params import SamplingParams
from .prompt import INLINE_PROMPT, Prompt, prompt_ids, prompt_size
from .samples import sample_params
from .scheduler import check_size


@dataclass
class ClientRequest:
    """A request sent to the core: its prompt ids, the output processor of each sample (and which ended), the
    queue they share, and the core's answer to it (None: queued; or the error that refused it)."""

    ids: list[int]
    outputs: list[OutputProcessor]
    queue: PieceQueue
    taken: asyncio.Future[BaseException | None]
    ended: list[bool] = field(default_factory=list)


class EngineProcess(Front):
    """An :class:`~batchgpu.llm.Engine` of ``options`` in a process of its own (started here, spawned; the
    model loads there, and its tokenizer here), with the engine's request API: :meth:`generate`,
    :meth:`check_room`, :attr:`stats`, :meth:`load`, :meth:`status`. :meth:`close` stops the process (so does
    this process's exit). ``timeout``: seconds to wait for the core to be ready (None: as long as it takes)."""

    def __init__(self, options: EngineOptions, *, timeout: float | None = None) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked device or threads
        self.conn, child = context.Pipe()
        self.process = context.Process(target=run_core, args=(child, options), name="batchgpu-core", daemon=True)
        self.process.start()
        child.close()
        facts = self._ready(timeout)
        self.config, self.max_context = facts["config"], facts["max_context"]
        self.max_batch, self.max_waiting = facts["max_batch"], facts["max_waiting"]
        self.pool_size = facts["block_size"], facts["blocks"]  # the core's KV blocks: a request must fit them
        self.codec = open_weights(facts["path"]).codec()
        self.stats, self.room = EngineStats(), engine_places(self.max_batch, self.max_waiting)
        self.requests: dict[int, ClientRequest] = {}
        self.calls: dict[int, asyncio.Future[Any]] = {}
        self.ids = itertools.count()
        self.latest = Load()
        self.failure: BaseException | None = None  # why the core process is gone, once it is
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop that reads the core's messages
        self.outgoing: queue.SimpleQueue[Any] = queue.SimpleQueue()  # sent on a thread: a send never stalls the loop
        self.sender = threading.Thread(target=self._send_all, name="batchgpu-core-send", daemon=True)
        self.receiver = threading.Thread(target=self._receive_all, name="batchgpu-core-receive", daemon=True)
        self.sender.start()
        self.receiver.start()
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchgpu-tokenize")

    def _ready(self, timeout: float | None) -> dict[str, Any]:
        """The core's facts once it is ready; where it never is, its error (the process ended and reaped)."""
        try:
            if not self.conn.poll(timeout):
                self.process.terminate()
                raise BatchError(f"the engine's core process was not ready after {timeout} s")
            try:
                kind, facts = self.conn.recv()
            except EOFError:
                self.process.join()
                code = self.process.exitcode
                raise BatchError(f"the engine's core process exited ({code}) before it was ready") from None
        except BaseException:
            self.process.join()
            raise
        if kind == "failed":
            self.process.join()
            raise facts
        return facts

    # the request API -----------------------------------------------------------------------------------

    async def start(self, prompt: Prompt, params: SamplingParams, trusted: bool) -> Started:
        """Tokenize ``prompt`` (large ones on a thread) and send it to the core, which queues its samples or
        refuses it (RequestError where it can never serve it)."""
        self._listen()
        arrival, loop = clock(), asyncio.get_running_loop()
        encode = (self.codec, self.config.vocab, prompt, trusted, params.tools)
        if prompt_size(prompt) <= INLINE_PROMPT:
            ids = prompt_ids(*encode)
        else:
            ids = await loop.run_in_executor(self._tokenizing, prompt_ids, *encode)
        check_size(len(ids), params.max_tokens, self.max_context, *self.pool_size)  # here: no prompt sent to refuse
        pieces = PieceQueue()
        outputs = [
            OutputProcessor(self.codec, sample, len(ids), self.stats, arrival, queue=pieces, index=index)
            for index, sample in enumerate(sample_params(params))
        ]
        request = ClientRequest(ids, outputs, pieces, loop.create_future(), [False] * len(outputs))
        number = next(self.ids)
        self._send(("add", number, ids, params))  # its answer comes on this thread's loop: after this
        self.requests[number] = request
        try:
            refused = await request.taken
        except BaseException:  # cancelled meanwhile
            self._end(number)
            raise
        if refused is not None:
            self.requests.pop(number, None)
            raise refused
        return pieces, len(outputs), lambda: self._end(number)

    def _end(self, number: int) -> None:
        """The request is over for its caller: the core cancels what of it runs and forgets it."""
        if self.requests.pop(number, None) is not None and self.failure is None:
            self._send(("end", number, None))

    def load(self) -> Load:
        """The core's load after its latest step (metrics)."""
        return self.latest

    async def status(self) -> dict[str, Any]:
        """The core engine's :meth:`~batchgpu.llm.Engine.status`."""
        return await self.call(_status)

    async def call(self, function: Callable[..., Any], *arguments: Any) -> Any:
        """``function(engine, *arguments)`` in the core process (``function`` and its arguments pickled: a
        module's function), its result here."""
        self._listen()
        number, answer = next(self.ids), asyncio.get_running_loop().create_future()
        self._send(("call", number, pickle.dumps((function, arguments))))
        self.calls[number] = answer
        return await answer

    def close(self) -> None:
        """Stop the core process (and what waits on it here)."""
        if self.process.is_alive() and self.failure is None:
            self._send(("close",))
            self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()
        self.receiver.join(10)  # it saw the pipe's end: what waited here has failed
        self.outgoing.put(None)
        self._tokenizing.shutdown(wait=False)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # the pipe ------------------------------------------------------------------------------------------

    def _send(self, message: tuple[Any, ...]) -> None:
        """Send ``message`` (pickled here: what cannot be raises to the caller) on the sending thread."""
        if self.failure is not None:
            raise self.failure
        self.outgoing.put(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))

    def _send_all(self) -> None:
        while (data := self.outgoing.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except OSError:  # the core is gone: the receiving thread finds out
                return

    def _listen(self) -> None:
        """Hand the core's messages to the running event loop from now on (the requests and calls wait there)."""
        if self.failure is not None:
            raise self.failure
        self.loop = asyncio.get_running_loop()

    def _receive_all(self) -> None:
        """The receiving thread: each message of the core (a blocking read: no event loop owns the pipe, and
        uvloop would make it non-blocking) goes to the event loop; the pipe's end is the core's end."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                self.process.join(5)
                self.failure = BatchError(f"the engine's core process ended (exit code {self.process.exitcode})")
                self._on_loop(self._lost)
                return
            self._on_loop(self._receive, message)

    def _on_loop(self, function: Callable[..., None], *arguments: Any) -> None:
        loop = self.loop
        try:
            if loop is not None:
                loop.call_soon_threadsafe(function, *arguments)
        except RuntimeError:  # closed: nothing waits there any more
            pass

    def _receive(self, message: tuple[Any, ...]) -> None:
        if message[0] == "out":
            self._deliver(message[1], message[2])
            return
        _, number, result, error = message
        answer = self.calls.pop(number, None)
        if answer is not None and not answer.done():
            answer.set_exception(error) if error is not None else answer.set_result(result)

    def _deliver(self, items: list[Item], counts: CoreCounts) -> None:
        """A step's items: each request's tokens to its samples' output processors (a stop string one finds
        ends that sample in the core too), errors to their queues, the core's answers to the requests."""
        now = clock()
        self.latest, self.stats.steps, self.stats.iteration_tokens = counts.load, counts.steps, counts.iteration_tokens
        for number, index, *rest in items:
            request = self.requests.get(number)
            if request is None:
                continue
            if index is None:
                if not request.taken.done():
                    request.taken.set_result(rest[0])
                continue
            if request.ended[index]:
                continue
            output = request.outputs[index]
            if len(rest) == 1:  # the error that ends the sample
                request.ended[index] = True
                output.queue.put_nowait(rest[0])
            elif len(rest) == 2:
                output.add_prompt_logprobs(request.ids, rest[1], rest[0])
            elif output.take(rest[0], rest[1], now, rest[2] == GRAMMAR_END):
                request.ended[index] = True
                if rest[2] is None:  # a stop string, found here
                    self._send(("end", number, index))

    def _lost(self) -> None:
        """The core process is gone (:attr:`failure` says how): every request and call waiting on it fails."""
        assert self.failure is not None
        for request in self.requests.values():
            if not request.taken.done():
                request.taken.set_result(self.failure)
            for index, ended in enumerate(request.ended):
                if not ended:
                    request.outputs[index].queue.put_nowait(self.failure)
        for answer in self.calls.values():
            if not answer.done():
                answer.set_exception(self.failure)
        self.requests.clear()
        self.calls.clear()


def _status(engine: Any) -> dict[str, Any]:
    return engine.status()
