"""The places of a bounded service (the engine's sequences, the embedding service's texts): at most
``max_batch + max_waiting`` held at once, running, waiting or being tokenized; a request past that is refused
at once with :class:`~batchgpu.errors.OverloadedError` (the server's 429), one larger than the whole bound
with a RequestError; a request that ends gives its places back. ``max_waiting`` None: unbounded."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import BatchError, OverloadedError, RequestError


def check_max_waiting(owner: str, max_waiting: object) -> None:
    """BatchError naming ``owner`` unless ``max_waiting`` is None or an int >= 0."""
    if max_waiting is not None and (type(max_waiting) is not int or max_waiting < 0):
        raise BatchError(f"{owner}: max_waiting must be None or an int >= 0, got {max_waiting!r}")


@dataclass
class Places:
    """``held`` places of at most ``max_batch + max_waiting``. Refusals read "``owner`` is full: it holds
    ``held`` ``unit`` (``states``) ... this request ``verb`` ``count``"; ``too_many(count, most, bound)``
    makes the RequestError of a request larger than the bound."""

    max_batch: int
    max_waiting: int | None
    owner: str
    unit: str
    states: str
    verb: str
    too_many: Callable[[int, int, str], RequestError]
    held: int = 0

    def check(self, count: int) -> None:
        """Refuse a request of ``count`` places there is no room for now or ever (see the module)."""
        if self.max_waiting is None:
            return
        most = self.max_batch + self.max_waiting
        bound = f"(max_batch {self.max_batch} + max_waiting {self.max_waiting})"
        if count > most:
            raise self.too_many(count, most, bound)
        if self.held + count > most:
            raise OverloadedError(
                f"{self.owner} is full: it holds {self.held} {self.unit} ({self.states}) and takes at most {most} "
                f"{bound}; this request {self.verb} {count}: retry later"
            )

    @contextmanager
    def hold(self, count: int) -> Iterator[None]:
        """Hold ``count`` places while the block runs (:meth:`check` them first)."""
        self.held += count
        try:
            yield
        finally:
            self.held -= count
