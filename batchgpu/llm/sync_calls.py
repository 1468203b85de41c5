"""The engine's synchronous calls: :meth:`SyncCalls.generate_sync`, ``complete`` and ``complete_choices`` run
the asynchronous :meth:`~batchgpu.llm.Engine.generate` on a private event loop, one that the calls in
progress at once share (one step loop runs all their requests)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from ..errors import RequestError
from .output import Piece, choices, joined
from .params import SamplingParams
from .prompt import Prompt


class SyncCalls:
    """What an engine with ``generate`` (an async iterator of pieces) and ``driver`` (its step loop, stopped
    with the private loop) offers synchronous code."""

    driver: Any
    _sync_loop: asyncio.AbstractEventLoop | None = None  # the private loop, while calls are in progress
    _sync_calls = 0

    def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, *, trusted: bool = False
    ) -> AsyncIterator[Piece]:
        raise NotImplementedError

    def generate_sync(
        self, prompt: Prompt, params: SamplingParams | None = None, *, trusted: bool = False
    ) -> Iterator[Piece]:
        """:meth:`generate` for synchronous code: runs the engine on a private event loop meanwhile, one that
        the calls in progress at once share (one driver task runs all their requests), its driver stopped
        and the loop closed when the last of them ends (or is closed, as an iterator left open is when it
        is collected)."""
        if self._sync_loop is None:
            self._sync_loop = asyncio.new_event_loop()
        loop = self._sync_loop
        self._sync_calls += 1
        stream = self.generate(prompt, params, trusted=trusted)
        try:
            while True:
                try:
                    yield loop.run_until_complete(stream.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            try:
                loop.run_until_complete(stream.aclose())  # type: ignore[attr-defined]
            finally:
                self._sync_calls -= 1
                if self._sync_calls == 0:
                    self._sync_loop = None
                    self.driver.stop(loop)
                    loop.close()

    def complete(self, prompt: Prompt, params: SamplingParams | None = None, *, trusted: bool = False) -> Piece:
        """The whole generation as one :class:`Piece` (synchronous); a request with ``n`` > 1 is refused
        (RequestError): :meth:`complete_choices` returns its samples."""
        if params is not None and isinstance(params, SamplingParams) and params.n > 1:
            raise RequestError(f"complete returns one generation, got n={params.n}: use complete_choices", "n")
        return joined(list(self.generate_sync(prompt, params, trusted=trusted)))

    def complete_choices(
        self, prompt: Prompt, params: SamplingParams | None = None, *, trusted: bool = False
    ) -> list[Piece]:
        """The ``n`` samples of a request, each as one :class:`Piece`, in index order (synchronous)."""
        return choices(list(self.generate_sync(prompt, params, trusted=trusted)))
