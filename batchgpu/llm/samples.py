"""A request's samples (``n``, ``best_of``): one scheduler sequence each, sample ``i`` drawing with seed
``seed + i`` (as vLLM v1 seeds its child requests, so sample 0 is the request with ``n`` 1) and the later
ones sharing the first's prompt blocks; their pieces as they come, or with ``best_of`` > ``n`` the ``n``
samples of highest cumulative logprob."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from .output import Piece, PieceQueue, choices, cumulative_logprob
from .params import SamplingParams
from .scheduler import Scheduler, Sequence


def add_samples(scheduler: Scheduler, ids: list[int], params: SamplingParams, seed: int) -> list[Sequence]:
    """Queue a sequence of prompt ``ids`` per sample of ``params`` on ``scheduler``: sample ``i`` with seed
    ``(seed + i) mod 2**32``, the later ones children of the first (:meth:`Scheduler.shared_prefix`)."""
    sequences: list[Sequence] = []
    for index, sample in enumerate(sample_params(params)):
        parent = sequences[0] if sequences else None
        sequences.append(scheduler.add(ids, sample, (seed + index) % 2**32, parent=parent))
    return sequences


def sample_params(params: SamplingParams) -> list[SamplingParams]:
    """The parameters of each sequence of a request: one per sample (``best_of``, or ``n``), each of
    ``n`` 1; the prompt's logprobs asked of the first alone (the others share its prompt blocks); with
    ``best_of`` > ``n``, every sampled token's logprob (the ranking needs it)."""
    single = dataclasses.replace(params, n=1, best_of=None)
    if params.best_of is not None and params.best_of > params.n and single.logprobs is None:
        single = dataclasses.replace(single, logprobs=0)
    rest = dataclasses.replace(single, prompt_logprobs=None)
    return [single, *[rest] * (params.samples - 1)]


def best_samples(samples: list[Piece], params: SamplingParams) -> list[Piece]:
    """The ``n`` of ``samples`` with the highest cumulative logprob, best first, indexed 0..n-1 (without
    their token logprobs where the request did not ask for them)."""
    best = sorted(samples, key=cumulative_logprob, reverse=True)[: params.n]
    for index, piece in enumerate(best):
        piece.index = index
        if params.logprobs is None:
            piece.logprobs = None
    return best


async def pieces_of(queue: PieceQueue, samples: int) -> AsyncIterator[Piece]:
    """The pieces of a request's ``samples`` as they come, until each has ended (an error ends them all)."""
    while samples:
        item = queue.items.popleft() if queue.items else await queue.get()
        if isinstance(item, BaseException):
            raise item
        yield item
        samples -= item.finish_reason is not None


def request_pieces(queue: PieceQueue, samples: int, params: SamplingParams) -> AsyncIterator[Piece]:
    """The pieces a request's caller gets: every sample's as they come (:func:`pieces_of`), or with
    ``best_of`` > ``n`` the best ``n`` samples, each whole (:func:`best_samples`), once all have ended."""
    if params.best_of is not None and params.best_of > params.n:
        return best_pieces(queue, samples, params)
    return pieces_of(queue, samples)


async def best_pieces(queue: PieceQueue, samples: int, params: SamplingParams) -> AsyncIterator[Piece]:
    """The best ``params.n`` of a request's ``samples``, each as one piece, once all have ended."""
    collected = [piece async for piece in pieces_of(queue, samples)]
    for piece in best_samples(choices(collected), params):
        yield piece
