"""The engine's step loop (vLLM v1's engine core): one asyncio task per event loop runs ``schedule() ->
plan``, ``run(plan)``, ``update(plan, tokens)``: :mod:`~batchgpu.llm.scheduler` decides each step,
:class:`~batchgpu.llm.step.StepRunner` packs and submits it (sampling on the device), each sequence's
:class:`~batchgpu.llm.output.Output` takes its tokens (an output processor turns them into pieces of text; in
a core process of its own, :class:`~batchgpu.llm.core_output.CoreOutput` sends them to the client's).

Up to ``ahead + 1`` steps are in flight: the host plans, packs and submits step N+1 (and N+2) while the
device computes step N, and turns step N's tokens into text while the later steps run (on a GPU; on the
CPU devices the host is the device, and ``ahead`` is 0 by default)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any

from ..errors import BatchError
from .metrics import EngineStats, clock
from .output import Output, Piece, hand_prompt_logprobs
from .scheduler import Scheduler, Sequence, SequenceState, StepKind, StepPlan
from .speculation import Speculator
from .step import StepRunner, Submitted


class Driver:
    """The step loop over ``scheduler`` and ``runner`` with ``ahead`` steps submitted before the oldest is
    read; ``outputs`` holds the output processor of every unfinished sequence, ``stats`` counts the steps."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: StepRunner,
        stats: EngineStats,
        ahead: int,
        speculator: Speculator | None = None,
    ) -> None:
        self.scheduler, self.runner, self.stats, self.ahead = scheduler, runner, stats, ahead
        self.speculator = speculator  # speculative decoding's (its steps run one at a time: ahead 0)
        self.outputs: dict[Sequence, Output] = {}
        self.wake = asyncio.Event()  # a new one with each task (an event is bound to one loop)
        self.task: asyncio.Task | None = None

    # sequences ------------------------------------------------------------------------------------------

    def add(self, sequence: Sequence, output: Output) -> None:
        """Serve ``sequence`` (queued on the scheduler), its pieces going through ``output``; the task starts
        on the running event loop where it does not run there."""
        self.outputs[sequence] = output
        self.start()
        self.wake.set()

    def end(self, sequence: Sequence, item: Piece | BaseException | None = None) -> None:
        """A request ends (its slot and blocks free for the next step); ``item`` goes to its queue."""
        self.scheduler.finish(sequence)
        output = self.outputs.pop(sequence, None)
        if output is not None and item is not None:
            output.queue.put_nowait(item)

    def end_unfinished(self, sequences: list[Sequence], error: BaseException | None = None) -> bool:
        """End the requests of ``sequences`` that have not ended (with ``error``); whether any had not."""
        unfinished = [sequence for sequence in sequences if sequence.state is not SequenceState.FINISHED]
        for sequence in unfinished:
            self.end(sequence, error)
        return bool(unfinished)

    # the task -------------------------------------------------------------------------------------------

    @property
    def failure(self) -> BaseException | None:
        """The error that ended the task, if one did."""
        task = self.task
        return None if task is None or not task.done() or task.cancelled() else task.exception()

    def start(self) -> None:
        """Start the task on the running event loop unless it runs there."""
        loop = asyncio.get_running_loop()
        if self.task is None or self.task.done() or self.task.get_loop() is not loop:
            self.wake = asyncio.Event()
            self.task = loop.create_task(self.run())

    def stop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Cancel the task of ``loop`` (a private loop of :meth:`~batchgpu.llm.Engine.generate_sync`)."""
        if self.task is not None and self.task.get_loop() is loop:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                loop.run_until_complete(self.task)
            self.task = None

    async def run(self) -> None:
        """:meth:`drive`; an error that ends it fails every request it holds (which would otherwise wait
        forever) and the next request starts a new task."""
        try:
            await self.drive()
        except Exception as exc:
            error = exc if isinstance(exc, BatchError) else BatchError(f"the engine's scheduler failed: {exc!r}")
            self.end_unfinished(self.scheduler.unfinished(), error)
            raise

    # the loop -------------------------------------------------------------------------------------------

    async def drive(self) -> None:
        """Submit planned steps while fewer than ``ahead + 1`` are in flight, then read the oldest and
        deliver its tokens; wait when there is nothing to run. A split step's sampling part goes once the
        steps before it are read (its grammar rows' masks need their tokens), before anything else."""
        in_flight: deque[Submitted] = deque()
        while True:
            if in_flight and in_flight[-1].pending:  # its masks need the tokens of the steps before
                if len(in_flight) > 1:
                    await self.complete(in_flight.popleft())
                elif self.submit(in_flight[-1].plan, self.runner.sample, in_flight[-1]) is None:
                    in_flight.pop()
                continue
            plan = self.scheduler.schedule() if len(in_flight) <= self.ahead else None
            if plan is not None and self.speculator is not None:
                plan = await self.drafted(plan)
            if plan is not None:
                submitted = self.submit(plan, self.runner.run, plan)
                if submitted is not None:
                    self.stats.step(plan.kind.value, plan.rows)
                    in_flight.append(submitted)
                continue
            if not in_flight:
                self.wake.clear()
                await self.wake.wait()
                continue
            await self.complete(in_flight.popleft())
            await asyncio.sleep(0)  # let consumers take their pieces between steps

    async def drafted(self, plan: StepPlan) -> StepPlan | None:
        """``plan`` with its sequences' drafts (a verify step), or as it was; where drafting fails, its requests
        fail (None) and the engine goes on."""
        assert self.speculator is not None
        try:
            return await self.speculator.speculate(plan)
        except Exception as exc:
            error = exc if isinstance(exc, BatchError) else BatchError(f"drafting failed: {exc!r}")
            self.end_unfinished([chunk.sequence for chunk in plan.chunks], error)
            return None

    def submit(self, plan: StepPlan, submit: Callable[[Any], Any], argument: Any) -> Any:
        """``submit(argument)``: run ``plan``'s step (or its sampling part); where packing or submitting fails,
        its requests fail (None) and the engine goes on."""
        try:
            return submit(argument)
        except Exception as exc:
            error = exc if isinstance(exc, BatchError) else BatchError(f"the {plan.kind.value} step failed: {exc!r}")
            self.end_unfinished([chunk.sequence for chunk in plan.chunks], error)
            return None

    async def complete(self, submitted: Submitted) -> None:
        """Read a step's tokens and hand each to its request's output processor; a piece that ends its
        generation ends the request."""
        plan = submitted.plan
        try:
            samples = await submitted.read_async()
            logprobs = await submitted.logprobs_async(samples)
        except BatchError as exc:
            self.end_unfinished([chunk.sequence for chunk in plan.chunks], exc)
            return
        sampled = hand_prompt_logprobs(self.outputs, plan.chunks, logprobs)
        if plan.kind is StepKind.VERIFY:
            assert self.speculator is not None
            taken = self.speculator.verified(plan, samples)
            drafted = [(sequence.slot, tokens[-1]) for (sequence, tokens), c in zip(taken, plan.chunks) if c.draft]
            self.runner.put_tokens([slot for slot, _ in drafted], [token for _, token in drafted])
        else:
            taken = [(sequence, [token]) for sequence, token in self.scheduler.update(plan, [s[0] for s in samples])]
        now, outputs = clock(), self.outputs  # the step's tokens all arrive now
        for sequence, tokens in taken:  # each to its output (a piece for them all); those that end it end the request
            if outputs[sequence].take(tokens, sampled.get(sequence), now):
                self.end(sequence)
