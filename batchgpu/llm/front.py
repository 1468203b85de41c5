"""What a caller of an engine meets, whichever process runs its steps (:class:`~batchgpu.llm.Engine` in this
one, :class:`~batchgpu.llm.engine_process.EngineProcess` in a core process of its own): a generation's
life as its caller sees it. Its parameters are checked; a place is held per sample while it runs (refused
at once past ``max_batch + max_waiting``: :mod:`~batchgpu.llm.admission`); its pieces come from the queue
the engine hands them to, the last carrying the request's usage; and its outcome is counted once in the
engine's :class:`~batchgpu.llm.metrics.EngineStats`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from ..errors import OverloadedError, RequestError
from .admission import Places
from .metrics import EngineStats
from .output import Piece, PieceQueue, Tally
from .params import SamplingParams
from .prompt import Prompt
from .samples import request_pieces

Started = tuple[PieceQueue, int, Callable[[], None]]
"""A request an engine took: the queue of its pieces, how many samples deliver to it, and how to cancel it
(its slots and blocks free at once; nothing for the samples that ended)."""


def engine_places(max_batch: int, max_waiting: int | None) -> Places:
    """The places of an engine's sequences: running, waiting or being tokenized."""
    return Places(
        max_batch, max_waiting, owner="the engine", unit="sequences", states="running, waiting or being tokenized",
        verb="needs", too_many=lambda count, most, bound: RequestError(
            f"{count} samples; this engine holds at most {most} sequences"),
    )  # fmt: skip


class Front:
    """An engine's public request API over ``stats``, ``room`` and :meth:`start` (which takes a request whose
    places are held, and raises RequestError where the engine can never serve it)."""

    stats: EngineStats
    room: Places

    def start(self, prompt: Prompt, params: SamplingParams, trusted: bool) -> Awaitable[Started]:
        raise NotImplementedError

    def generate(
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
        return self._served(prompt, params, trusted)

    async def _served(self, prompt: Prompt, params: SamplingParams | None, trusted: bool) -> AsyncIterator[Piece]:
        outcome: str | None = "refused"  # until the request is queued; None once counted
        try:
            params = params if params is not None else SamplingParams()
            if not isinstance(params, SamplingParams):
                raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}", "params")
            with self._places(params):  # OverloadedError before anything is done for the request
                queue, samples, cancel = await self.start(prompt, params, trusted)
                outcome, tally = "aborted", Tally(params.n)  # queued: it finishes, fails or its caller stops
                try:
                    async for piece in request_pieces(queue, samples, params):
                        usage = tally.take(piece)
                        if usage is not None:
                            self.stats.finish(usage.prompt_tokens, usage.completion_tokens, usage.finish_reasons)
                            outcome = None
                        yield piece
                finally:
                    cancel()
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
    def held(self) -> int:
        """Sequences of the requests taken and not ended: running, waiting or being tokenized."""
        return self.room.held

    @contextlib.contextmanager
    def _places(self, params: SamplingParams) -> Iterator[None]:
        """Hold a place per sample of a request while it runs (:attr:`held`), refused by :meth:`check_room`."""
        needed = params.samples
        self.check_room(needed, "best_of" if needed > params.n else "n")
        with self.room.hold(needed):
            yield
