"""Every command's flags checked in one place, before the command starts: :data:`RULES` holds, per command,
rows of a flag and what its value must be; :func:`check` runs them in order and the first a value fails
raises :class:`FlagError` with one line, ``batchgpu <command>: <flag> must be <what>, got <value>``, which the
command line prints with exit code 2 before a model is loaded, a file written or a port bound.

Numbers have bounds both ways (a flag's upper bound is far past any real use, below what would exhaust
memory before a clearer check could refuse it); names are one of what their owner knows (executor kinds,
synthetic presets, formats, benchmarks); input paths exist and are what the command reads (a GGUF file
told by its magic, a Hugging Face directory by its config.json), and a model is opened far enough to parse
its header and config (its trained context bounds ``--max-context``) without loading weights; an output
path never reaches an input (a model inside the export folder or linked from it, a trace onto the script
profiled) and its folder exists; a server's port lies in 1-65535 (0, any free port, is refused: the server
would not listen where it says) and is free on its host."""

from __future__ import annotations

import argparse
import functools
import math
import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import check as check_command
from .arguments import brief, linked_within, within
from .errors import ArgumentError, BatchError
from .executors import KINDS
from .export.chat import MANIFEST
from .export.chat_steps import MAX_SPECULATIVE_TOKENS
from .export.webgpu import out_dir_problem
from .models.gguf_reader import MAGIC
from .models.synth import FILE_TYPES, PRESETS, VOCABULARIES


class FlagError(ArgumentError):
    """A command-line flag its command refuses; the message is the one line the command prints (exit 2)."""


@dataclass(frozen=True)
class Refusal:
    """What a refused value must be, and what is wrong with it where its value alone does not say."""

    must: str
    why: str = ""


Check = Callable[[Any, argparse.Namespace], Refusal | None]


@dataclass(frozen=True)
class Rule:
    """A flag as typed (``--port``), a positional argument by name (``out``) or an environment variable
    (``$BATCHGPU_DEVICE``), and its check; a value not given (None) is checked only ``always`` (a default
    that may be missing), a variable not when the flag ``unless`` is given."""

    flag: str
    check: Check
    unless: str = ""
    always: bool = False

    def value(self, args: argparse.Namespace) -> Any:
        if self.unless and getattr(args, dest(self.unless)) is not None:
            return None
        if self.flag.startswith("$"):
            return os.environ.get(self.flag[1:]) or None
        return getattr(args, dest(self.flag))


def dest(flag: str) -> str:
    """The namespace attribute of a flag: ``--max-batch`` -> ``max_batch``."""
    return flag.lstrip("-").replace("-", "_")


def shown(value: Any) -> str:
    """A value as a refusal shows it: short, on one line."""
    return "none" if value is None else brief(value)


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def check(args: argparse.Namespace) -> None:
    """Run the rules of ``args.command`` in order; FlagError at the first value one refuses."""
    for rule in RULES[args.command]:
        value = rule.value(args)
        if value is None and not rule.always:
            continue
        refusal = rule.check(value, args)
        if refusal is not None:
            why = f" ({one_line(refusal.why)})" if refusal.why else ""
            raise FlagError(f"batchgpu {args.command}: {rule.flag} must be {refusal.must}, got {shown(value)}{why}")


# numbers and names ---------------------------------------------------------------------------------------


def ints(low: int, high: int) -> Check:
    """An int from ``low`` to ``high``."""

    def check(value: int, args: argparse.Namespace) -> Refusal | None:
        if value < low:
            return Refusal(f"at least {low}")
        return Refusal(f"at most {high}") if value > high else None

    return check


def reals(low: float, high: float, *, above: bool = False) -> Check:
    """A finite number from ``low`` (``above``: greater than ``low``) to ``high``."""

    def check(value: float, args: argparse.Namespace) -> Refusal | None:
        if not math.isfinite(value):
            return Refusal("a finite number")
        if value < low or (above and value == low):
            return Refusal(f"greater than {low:g}" if above else f"at least {low:g}")
        return Refusal(f"at most {high:g}") if value > high else None

    return check


def one_of(names: Iterable[str]) -> Check:
    """One of ``names``."""
    known = tuple(names)

    def check(value: str, args: argparse.Namespace) -> Refusal | None:
        return None if value in known else Refusal(f"one of {', '.join(known)}")

    return check


def some_of(names: Iterable[str]) -> Check:
    """A comma-separated list of ``names``."""
    known = tuple(names)

    def check(value: str, args: argparse.Namespace) -> Refusal | None:
        unknown = [name for name in value.split(",") if name not in known] if value else []
        return Refusal(f"a comma-separated list of {', '.join(known)}") if unknown else None

    return check


def counts(low: int, high: int) -> Check:
    """A comma-separated list of ints from ``low`` to ``high``."""

    def check(value: str, args: argparse.Namespace) -> Refusal | None:
        items = value.split(",")
        if all(item.isdecimal() and len(item) < 10 and low <= int(item) <= high for item in items):
            return None
        return Refusal(f"a comma-separated list of ints from {low} to {high}")

    return check


def step_tokens(value: int, args: argparse.Namespace) -> Refusal | None:
    """At least ``--max-batch`` (the engine's default where not given): a step carries a row for every decoding
    sequence."""
    from .llm.options import EngineOptions

    bound = EngineOptions.max_batch if args.max_batch is None else args.max_batch
    return Refusal(f"at least --max-batch ({bound})") if value < bound else None


def power_of_two_to(other: str) -> Check:
    """A power of two no larger than the value of the flag ``other`` (``--max-context``: as resolved)."""

    def check(value: int, args: argparse.Namespace) -> Refusal | None:
        bound = max_context(args) if other == "--max-context" else getattr(args, dest(other))
        return None if value & (value - 1) == 0 and value <= bound else Refusal(f"a power of two <= {other} ({bound})")

    return check


def fewer_than_context(value: int, args: argparse.Namespace) -> Refusal | None:
    """Fewer than ``--max-context`` (as resolved): a verify step's rows, the latest token and this many drafted
    ones, fit in the KV cache."""
    bound = max_context(args)
    return None if value < bound else Refusal(f"less than --max-context ({bound}): a verify step takes it + 1 rows")


def device_kind(value: str, args: argparse.Namespace) -> Refusal | None:
    """An executor kind (:data:`batchgpu.executors.KINDS`)."""
    return one_of(KINDS)(value, args)


def benchmarks(value: str, args: argparse.Namespace) -> Refusal | None:
    """``all``, ``none`` or benchmarks of ``check`` (:func:`batchgpu.check.select_benchmarks`)."""
    try:
        check_command.select_benchmarks(value)
    except ValueError as exc:
        return Refusal("all, none or a comma-separated list of benchmarks", str(exc))
    return None


# paths -----------------------------------------------------------------------------------------------------


def readable_file(value: str, args: argparse.Namespace) -> Refusal | None:
    """An existing file this process may read."""
    return path_problem(Path(value), "a readable file", directory=False)


def path_problem(path: Path, must: str, *, directory: bool) -> Refusal | None:
    """A refusal where ``path`` is not an existing, readable regular file (``directory``: folder); a pipe or
    a device is no file (reading one could wait forever)."""
    if not path.exists():
        return Refusal(must, "no such file or directory")
    if path.is_dir() != directory:
        return Refusal(must, "a directory" if path.is_dir() else "not a directory")
    if not directory and not path.is_file():
        return Refusal(must, "not a regular file")
    if not os.access(path, os.R_OK | (os.X_OK if directory else 0)):
        return Refusal(must, "permission denied")
    return None


def new_file(value: str, args: argparse.Namespace) -> Refusal | None:
    """A file to write: its folder exists and may be written, and it is not a folder ("" where the flag allows
    none)."""
    path = Path(value)
    must = "a file path in an existing folder"
    if value == "":
        return None
    if path.is_dir() or not path.parent.is_dir():
        return Refusal(must, "a directory" if path.is_dir() else "no such folder")
    return None if os.access(path.parent, os.W_OK | os.X_OK) else Refusal(must, "the folder is not writable")


def new_gguf(value: str, args: argparse.Namespace) -> Refusal | None:
    """A GGUF file to write: :func:`new_file`, replacing at most an earlier GGUF file."""
    refusal = new_file(value, args) if value else Refusal("a file path", "empty")
    if refusal is not None or not Path(value).exists():
        return refusal
    return None if gguf_magic(Path(value)) else Refusal("a new file or a GGUF file to replace", "not a GGUF file")


def new_folder(value: str, args: argparse.Namespace) -> Refusal | None:
    """A folder to write into, made where missing: no file lies where it or a folder above it goes."""
    path = Path(value).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    must = "a folder (or a path where one can be made)"
    if not path.is_dir():
        return Refusal(must, f"{path} is a file")
    return None if os.access(path, os.W_OK | os.X_OK) else Refusal(must, f"{path} is not writable")


def distinct_from(other: str) -> Check:
    """An output that is not the file of the flag ``other`` (by any path or link)."""

    def check(value: str, args: argparse.Namespace) -> Refusal | None:
        given = getattr(args, dest(other))
        return Refusal(f"another file than {other}") if given and same_file(Path(value), Path(given)) else None

    return check


def same_file(path: Path, other: Path) -> bool:
    """Whether two paths name one file: the same path once links are resolved, or one file by two names."""
    if path.resolve() == other.resolve():
        return True
    return path.exists() and other.exists() and os.path.samefile(path, other)


def gguf_magic(path: Path) -> bool:
    """Whether the file starts as a GGUF file does."""
    try:
        with path.open("rb") as file:
            return file.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


# models ----------------------------------------------------------------------------------------------------

MODEL = "a GGUF file or a Hugging Face model directory"


def model_path(value: str | None) -> Path:
    """``--model`` as a path; the default model (SmolLM2) where none is given (BatchError if not installed)."""
    from .models.llama import smollm2_path

    return Path(value) if value is not None else smollm2_path()


def served_model(value: str | None, args: argparse.Namespace) -> Refusal | None:
    """A model ``serve`` can open: a GGUF file (by its magic) or a directory with a config.json; a decoder's
    header and config parse (:func:`trained_context`)."""
    try:
        path = model_path(value)
    except BatchError as exc:
        return Refusal("given here (the default model is not installed)", str(exc))
    refusal = path_problem(path, MODEL, directory=path.is_dir())
    if refusal is not None:
        return refusal
    if path.is_dir() and not (path / "config.json").is_file():
        return Refusal(MODEL, "a directory without config.json")
    if path.is_file() and not gguf_magic(path):
        return Refusal(MODEL, "not a GGUF file")
    return opened(path, MODEL)


def gguf_model(value: str, args: argparse.Namespace) -> Refusal | None:
    """A GGUF file whose header and config parse."""
    path = Path(value)
    refusal = path_problem(path, "a GGUF file", directory=False)
    if refusal is not None or not gguf_magic(path):
        return refusal or Refusal("a GGUF file", "not a GGUF file")
    return opened(path, "a GGUF file")


def speculation(value: str, args: argparse.Namespace) -> Refusal | None:
    """``ngram:K`` or ``draft:PATH:K`` (:meth:`~batchgpu.models.speculative.Speculative.parse`), a draft model
    ``serve`` can open."""
    from .models.speculative import Speculative

    try:
        settings = Speculative.parse(value)
    except ArgumentError as exc:
        return Refusal("ngram:K or draft:PATH:K with K >= 1", str(exc).split(", got")[0])
    return None if settings.draft is None else served_model(str(settings.draft), args)


def opened(path: Path, must: str) -> Refusal | None:
    """A refusal where the model's header or config does not parse (an encoder is opened by its server)."""
    from .models.encoder import is_encoder

    try:
        if not is_encoder(path):
            trained_context(path)
    except Exception as exc:  # the file is untrusted input: whatever it makes the reader raise is a refusal
        return Refusal(must, f"{type(exc).__name__}: {exc}" if not isinstance(exc, BatchError) else str(exc))
    return None


def trained_context(path: Path) -> int | None:
    """The context a decoder model was trained for (None: its file does not say), from its header and
    config alone (read once per version of the file: the rules of one command ask twice)."""
    stat = path.stat()
    return context_of(path.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def context_of(path: Path, mtime_ns: int, size: int) -> int | None:
    from .models.loader import open_weights

    return open_weights(path).config.context


def within_trained(model_flag: str) -> Check:
    """At most the trained context of the decoder of the flag ``model_flag``."""

    def check(value: int, args: argparse.Namespace) -> Refusal | None:
        from .models.encoder import is_encoder

        path = model_path(getattr(args, dest(model_flag)))
        trained = None if is_encoder(path) else trained_context(path)
        return Refusal(f"at most {trained} (the model's trained context)") if trained and value > trained else None

    return check


DEFAULT_CONTEXT = {"serve": 2048, "export-chat": 1024}
"""A command's ``--max-context`` where none is given, at most the model's trained context."""


def max_context(args: argparse.Namespace) -> int:
    """``--max-context`` as given, or the command's default (:data:`DEFAULT_CONTEXT`) lowered to the trained
    context of the model of ``--model`` (a model too short for the default still serves, whole)."""
    if args.max_context is not None:
        return args.max_context
    from .models.encoder import is_encoder

    default, path = DEFAULT_CONTEXT[args.command], model_path(args.model)
    trained = None if is_encoder(path) else trained_context(path)
    return min(default, trained) if trained else default


def generation_only(value: bool, args: argparse.Namespace) -> Refusal | None:
    """Off for an encoder model (``--ray`` serves generation models; an encoder is served in one process)."""
    from .models.encoder import is_encoder

    if value and is_encoder(model_path(args.model)):
        return Refusal("off for an encoder model (Ray serves generation models; an encoder runs in one process)")
    return None


def outside(folder_flag: str) -> Check:
    """A file writing into the folder of the flag ``folder_flag`` does not reach: not under that folder."""

    def check(value: str, args: argparse.Namespace) -> Refusal | None:
        inside = within(Path(value), Path(getattr(args, dest(folder_flag))))
        return None if inside is None else Refusal(f"a file outside the output folder ({folder_flag})", f"{inside}")

    return check


def unlinked(folder_flag: str) -> Check:
    """A file no file under the folder of the flag ``folder_flag`` is (a hard or symbolic link)."""

    def check(value: str, args: argparse.Namespace) -> Refusal | None:
        linked = linked_within(Path(value), Path(getattr(args, dest(folder_flag))))
        must = f"a file the output folder ({folder_flag}) does not hold by another name"
        return None if linked is None else Refusal(must, f"{linked} is the same file")

    return check


def export_folder(value: str, args: argparse.Namespace) -> Refusal | None:
    """A folder to export a chat app into: empty, or an earlier export."""
    problem = out_dir_problem(Path(value), MANIFEST)
    return None if problem is None else Refusal("an empty folder or an earlier export", f"it {problem}")


# servers ---------------------------------------------------------------------------------------------------


def host(value: str, args: argparse.Namespace) -> Refusal | None:
    """An address or a host name that resolves."""
    try:
        socket.getaddrinfo(value, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError) as exc:
        return Refusal("an address or a host name of this machine", str(exc))
    return None


def free_port(value: int, args: argparse.Namespace) -> Refusal | None:
    """A port this process may bind on ``--host`` now (as uvicorn will); not checked for a remote Ray cluster."""
    if getattr(args, "ray_address", None):
        return None
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((args.host, value))
        except OSError as exc:
            return Refusal(f"a port free on {args.host}", exc.strerror or str(exc))
    return None


# the table -------------------------------------------------------------------------------------------------

MAX_BATCH = 4096  # sequences (texts, for an encoder) decoded together
MAX_CONTEXT = 1 << 20  # before the model's trained context bounds it
MAX_STEP_TOKENS = 1 << 20
MAX_KV_BLOCKS = 1 << 20  # the block pool keeps host lists of this length
MAX_BLOCK_SIZE = 1024
MAX_QUEUE = 1 << 20  # --max-waiting, --max-connections
MAX_REQUEST_BYTES = 1 << 30
MAX_REPLICAS = 1024
MAX_OPS = 100_000  # bench's ops per chain
MAX_COUNT = 1 << 20  # repeats, rows shown
MAX_SECONDS = 7 * 24 * 3600.0
MAX_WORKERS = 1024
PORT = ints(1, 65535)

RULES: dict[str, tuple[Rule, ...]] = {
    "info": (),
    "bench": (
        Rule("--ops", counts(1, MAX_OPS)),
        Rule("--repeat", ints(1, MAX_COUNT)),
        Rule("--plot", new_file),
        Rule("--json", new_file),
        Rule("--json", distinct_from("--plot")),
        Rule("$BATCHGPU_DEVICE", device_kind),
    ),
    "profile": (
        Rule("script", readable_file),
        Rule("--top", ints(1, MAX_COUNT)),
        Rule("--trace", new_file),
        Rule("--trace", distinct_from("script")),
    ),
    "serve": (
        Rule("--port", PORT),
        Rule("--host", host),
        Rule("--device", device_kind),
        Rule("$BATCHGPU_DEVICE", device_kind, unless="--device"),
        Rule("--max-batch", ints(1, MAX_BATCH)),
        Rule("--max-context", ints(1, MAX_CONTEXT)),
        Rule("--max-step-tokens", ints(1, MAX_STEP_TOKENS)),
        Rule("--max-step-tokens", step_tokens),
        Rule("--kv-blocks", ints(1, MAX_KV_BLOCKS)),
        Rule("--block-size", ints(1, MAX_BLOCK_SIZE)),
        Rule("--max-request-bytes", ints(1, MAX_REQUEST_BYTES)),
        Rule("--max-waiting", ints(0, MAX_QUEUE)),
        Rule("--max-connections", ints(1, MAX_QUEUE)),
        Rule("--replicas", ints(1, MAX_REPLICAS)),
        Rule("--gpus-per-replica", reals(0, 1024)),
        Rule("--cpus-per-replica", reals(0, 1 << 16)),
        Rule("--port", free_port),
        Rule("--model", served_model, always=True),
        Rule("--max-context", within_trained("--model")),
        Rule("--ray", generation_only),
        Rule("--speculative", speculation),
        Rule("--header-timeout", reals(0, MAX_SECONDS)),
        Rule("--body-timeout", reals(0, MAX_SECONDS)),
    ),
    "synth": (
        Rule("--preset", one_of(PRESETS)),
        Rule("--format", one_of(FILE_TYPES)),
        Rule("--vocab", one_of(VOCABULARIES)),
        Rule("--seed", ints(0, 2**64 - 1)),
        Rule("--out", new_gguf),
    ),
    "export-chat": (
        Rule("--max-context", ints(1, MAX_CONTEXT)),
        Rule("--chunk", ints(1, MAX_CONTEXT)),
        Rule("--chunk", power_of_two_to("--max-context")),
        Rule("--speculative-tokens", ints(0, MAX_SPECULATIVE_TOKENS)),
        Rule("--speculative-tokens", fewer_than_context),
        Rule("--model", outside("out")),
        Rule("out", export_folder),
        Rule("--model", unlinked("out")),
        Rule("--model", gguf_model),
        Rule("--max-context", within_trained("--model")),
    ),
    "check": (
        Rule("--out", new_folder),
        Rule("--workers", ints(0, MAX_WORKERS)),
        Rule("--bench", benchmarks),
        Rule("--executors", some_of(KINDS)),
        Rule("--budget", reals(0, MAX_SECONDS, above=True)),
        Rule("--suite-timeout", reals(0, MAX_SECONDS, above=True)),
    ),
}
"""Per command, its flags' rules in the order they run: plain values first, then what opens a file or a port."""
