"""The grammar engine (llguidance): a request's :class:`~batchgpu.llm.structured.StructuredOutput` compiled
for the model's vocabulary, and per sequence a :class:`Guide` that writes the allowed-token bitmask of its
next token (the sampler applies it on the device, :meth:`batchgpu.GpuCommandBatch.sample`'s ``allowed``)
and takes each token read back.

llguidance builds its token trie from the model's ``tokenizers`` JSON once per engine (about 0.2 s for a
50k vocabulary) and needs no ahead-of-time compile per schema (a new schema's first mask in about a
millisecond; its own limits bound the work a hostile grammar can ask for). A mask costs 10-20 µs per row
on the host.

llguidance's matchers print nothing (log level 0): a request's grammar warnings (a lenient schema's keys
left out) and the error that stops a sequence's grammar go to the ``batchgpu.llm.grammar`` logger at
WARNING instead of the process' stderr; the error also fails its request
(:class:`~batchgpu.errors.GrammarError`). A panic of llguidance's (a Rust panic on a hostile schema is
pyo3's PanicException, which is no Exception) is the request's error too (:func:`panics`), never the
server's."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..errors import GrammarError, RequestError
from .params import SamplingParams
from .structured import JSON_LAYOUT, StructuredOutput
from .text import TextCodec
from .tools import tool_constraint, tool_format

log = logging.getLogger(__name__)


def constraint(params: SamplingParams, chat_template: str | None) -> StructuredOutput | None:
    """What a request's output is held to: its ``structured`` output, or the calls its ``tools`` require in
    the chat template's tool format (None: free text)."""
    if params.tools is not None:
        return tool_constraint(params.tools, tool_format(chat_template))
    return params.structured


@contextmanager
def panics(param: str, error: type[RequestError] = RequestError) -> Iterator[None]:
    """Turn a panic of llguidance's inside the block into ``error`` naming ``param`` (other exceptions pass)."""
    try:
        yield
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        reason = (str(exc).splitlines() or ["a panic"])[0][:200]
        log.warning("llguidance panicked on a request's grammar: %s", reason)
        raise error(f"the grammar engine failed on the {param}: {reason}", param) from None


def mask_words(vocab: int) -> int:
    """32-bit words of one row's allowed-token bitmask."""
    return (vocab + 31) // 32


class Guide:
    """One sequence's grammar state: :meth:`fill` its next token's allowed bitmask, :meth:`accept` each
    token read back; ``stopped`` once the grammar has ended (after its end-of-sequence token, or text
    nothing can follow). ``first``: the mask at the start, computed ahead (off the engine's loop: a
    grammar's first mask builds its lexer, the dearest one); ``param``: the request field its errors name."""

    def __init__(
        self, matcher: Any, first: np.ndarray | None = None, executor: Any = None, param: str = "response_format"
    ) -> None:
        self.matcher = matcher
        self.first = first
        self.executor = executor  # the engine's llguidance thread pool (:func:`fill_masks`)
        self.param = param

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed-token bitmask of the next token into ``row`` (uint32, :func:`mask_words` long)."""
        if self.first is not None:
            row[:] = self.first
            self.first = None
            return
        from llguidance.numpy import fill_next_token_bitmask

        with panics(self.param, GrammarError):
            fill_next_token_bitmask(self.matcher, row.view(np.int32).reshape(1, -1), 0)

    def accept(self, token: int) -> None:
        """Advance over ``token``; GrammarError where the grammar refuses it (a token the mask left out, -1:
        the mask allowed none, or the grammar engine's limits reached) or ends with it short of a whole
        output (it was stuck: nothing but the end could follow text its grammar does not accept)."""
        self.first = None
        with panics(self.param, GrammarError):
            consumed = token >= 0 and self.matcher.consume_token(token)
        if not consumed:
            error = (self.matcher.get_error() or f"token {token} is not allowed here").splitlines()[0]
            log.warning("llguidance: a request's grammar failed: %s", error)
            raise GrammarError(f"the output's grammar failed: {error}", self.param)
        if self.matcher.is_stopped() and not self.matcher.is_accepting():
            log.warning("llguidance: a request's grammar ended short of a whole output")
            message = "the output's grammar failed: it ended short of a whole output (nothing it allows comes next)"
            raise GrammarError(message, self.param)

    def draftable(self, draft: tuple[int, ...]) -> tuple[int, ...]:
        """The longest prefix of ``draft`` (speculative decoding's drafted tokens) that the grammar allows
        from its state now and that leaves it open (a token that ends it is sampled, never drafted)."""
        with panics(self.param, GrammarError):
            valid = self.matcher.validate_tokens(list(draft))
            taken = 0
            while taken < valid and self.matcher.consume_token(draft[taken]) and not self.matcher.is_stopped():
                taken += 1
            consumed = min(taken + 1, valid)  # the token that failed or stopped it was consumed too
            self.matcher.rollback(consumed)
        return draft[:taken]

    def fill_draft(self, rows: np.ndarray, draft: tuple[int, ...]) -> None:
        """The allowed-token bitmasks of a verify step's rows: ``rows[0]`` the next token's, ``rows[i]`` the
        one after ``draft[:i]`` (a :meth:`draftable` draft); the grammar's state is left as it was."""
        from llguidance.numpy import fill_next_token_bitmask

        self.first = None  # a verify step follows a token read back: the first mask is behind
        with panics(self.param, GrammarError):
            masks = rows.view(np.int32)
            fill_next_token_bitmask(self.matcher, masks, 0)
            for index, token in enumerate(draft, start=1):
                if not self.matcher.consume_token(token):
                    self.matcher.rollback(index - 1)
                    raise GrammarError(f"the output's grammar refused drafted token {token}", self.param)
                fill_next_token_bitmask(self.matcher, masks, index)
            self.matcher.rollback(len(draft))

    @property
    def stopped(self) -> bool:
        return bool(self.matcher.is_stopped())


def fill_masks(guides: list[tuple[Guide, int]], masks: np.ndarray) -> None:
    """Each guide's next allowed-token bitmask into its row of ``masks`` (uint32, (rows, words)): the
    first masks copied, the others computed by llguidance on its own threads, all rows at once (the GIL let
    go), as vLLM fills a batch's masks."""
    pending = []
    for guide, row in guides:
        if guide.first is not None or guide.executor is None:
            guide.fill(masks[row])
        else:
            pending.append((guide.matcher, row))
    if pending:
        from llguidance.numpy import fill_next_token_bitmask_par

        with panics(guides[0][0].param, GrammarError):
            fill_next_token_bitmask_par(guides[0][0].executor, pending, masks.view(np.int32))


class GrammarEngine:
    """The llguidance tokenizer of a model (``codec``; ``vocab``: its logits' width, which may exceed the
    tokenizer's), built on first use, and the grammars of requests."""

    def __init__(self, codec: TextCodec, vocab: int) -> None:
        self.codec, self.vocab = codec, vocab
        self.lock = threading.Lock()
        self.built: Any = None
        self.executor: Any = None  # llguidance's thread pool for a step's masks, made with the tokenizer

    def tokenizer(self) -> Any:
        with self.lock:
            if self.built is None:
                from llguidance import LLExecutor, LLTokenizer

                eos = min(self.codec.eos_ids) if self.codec.eos_ids else None
                self.built = LLTokenizer(self.codec.tokenizer.to_str(), n_vocab=self.vocab, eos_token=eos)
                self.executor = LLExecutor()
            return self.built

    def compile(self, output: StructuredOutput) -> str:
        """The llguidance grammar of ``output``, checked against the vocabulary (RequestError naming
        ``output.param`` where the schema or grammar is refused; safe to call from another thread)."""
        try:
            import llguidance  # noqa: F401
        except ImportError:
            message = "structured outputs need llguidance: pip install 'batchgpu[llm]'"
            raise RequestError(message, output.param) from None
        with panics(output.param):
            return self._compiled(output)

    def _compiled(self, output: StructuredOutput) -> str:
        from llguidance import LLMatcher

        try:
            if output.json_object:
                grammar = LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_LAYOUT)
            elif output.json_schema is not None:
                assert isinstance(output.json_schema, str)
                grammar = LLMatcher.grammar_from_json_schema(output.json_schema, defaults=JSON_LAYOUT)
            elif output.lark is not None:
                grammar = LLMatcher.grammar_from_lark(output.lark)
            else:
                grammar = LLMatcher.grammar_from_regex(output.regex or "")
        except (ValueError, TypeError) as exc:
            raise RequestError(f"the {output.param} is not valid: {exc}", output.param) from None
        problem = LLMatcher.validate_grammar(grammar, self.tokenizer())
        if problem:
            raise RequestError(f"the {output.param} is not valid: {problem.splitlines()[0][:300]}", output.param)
        return grammar

    def guides(self, grammar: str, count: int, param: str = "response_format") -> list[Guide]:
        """``count`` guides of one compiled ``grammar``, each at its start with its first mask computed
        (call it off the event loop); RequestError naming ``param`` where the grammar has no output at all
        (llguidance stops at once, finding nothing to write: a schema that only refers to itself)."""
        with panics(param):
            return self._guides(grammar, count, param)

    def _guides(self, grammar: str, count: int, param: str) -> list[Guide]:
        from llguidance import LLMatcher

        tokenizer = self.tokenizer()
        guides = [
            Guide(LLMatcher(tokenizer, grammar, log_level=0), executor=self.executor, param=param) for _ in range(count)
        ]
        for warning in guides[0].matcher.get_grammar_warnings():
            log.warning("llguidance: a request's grammar: %s", warning)
        first = np.zeros(mask_words(self.vocab), np.uint32)
        guides[0].fill(first)
        matcher = guides[0].matcher
        if matcher.is_stopped() and not matcher.is_accepting():
            reason = (matcher.get_error() or str(matcher.stop_reason())).splitlines()[0]
            message = f"the {param} cannot be followed: the grammar engine finds no output it allows ({reason})"
            raise RequestError(message, param)
        for guide in guides:
            guide.first = first.copy()
        return guides
