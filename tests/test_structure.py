"""The package's seams hold:

- no module of batchgpu reads a private name (``obj._name``) that another module of batchgpu defines. Each
  module reaches the others through their public names (the batch through ``GpuCommandBatch.view()``,
  executors through their protocol and public helpers). Private names of other libraries that batchgpu has
  to use are listed per module in ``THIRD_PARTY_PRIVATES`` with the reason, so a new one is a deliberate
  decision;
- imports go one way: every module sits on one of the layers of ``LAYERS`` (bottom to top) and imports only
  from its own layer and the ones below, with no cycle among the modules, counting imports under
  ``TYPE_CHECKING`` and inside functions. A lower module that needs a type from above declares a
  ``typing.Protocol`` of what it uses instead (``tensor.TensorBatch``, ``profiling.ProfiledBatch``);
- sync/async pairs are named alike at every level: ``x`` blocks, ``x_async`` awaits."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import batchgpu

PACKAGE = Path(batchgpu.__file__).resolve().parent

THIRD_PARTY_PRIVATES: dict[str, set[str]] = {
    # cffi's parser internals: the cold-start cache loads a pickled parse of wgpu-native's header (and
    # marks the parser it sped up with _batchgpu_fast)
    "coldstart.py": {
        "_parser",
        "_cdef",
        "_declarations",
        "_int_constants",
        "_anonymous_counter",
        "_recomplete",
        "_included_declarations",
        "_lock",
        "_cdef_version",
        "_cdefsources",
        "_batchgpu_fast",
        "_ffi",
    },
    # wgpu-py: the queue's native handle, for its timestamp period
    "executors/wgpu_timing.py": {"_ffi", "_internal"},
    # wgpu-py: its native backend module and the C handles of passes, pipelines and bind groups, for the
    # direct encode path (the plain path stays one environment variable away and is tested against it)
    "executors/wgpu_encode.py": {"_api", "_internal"},
    # ctypes: the file name a CDLL was loaded from (``python -m batchgpu info``)
    "executors/native/driver.py": {"_name"},
}


LAYERS: dict[str, tuple[str, ...]] = {
    # bottom to top; a path names a module of batchgpu/ (``tensor.py``) or every module under a folder (``ops/``)
    "base": (  # plain types and checks every layer uses: errors, dtypes, tensors, scalars, kernels, limits
        "errors.py",
        "arguments.py",
        "cache.py",
        "progress.py",
        "dtypes.py",
        "promotion.py",
        "quant.py",
        "quantize.py",
        "interop.py",
        "limits.py",
        "kernels.py",
        "tensor.py",
        "scalars.py",
    ),
    "op specs": ("ops/",),  # each op's shape and dtype rule, numpy reference and lowering to launches
    "kernel text": ("shaders.py", "cuda_source.py"),  # WGSL and CUDA sources rendered for launches
    "graph": ("recording.py", "fusion.py", "memory.py", "profiling.py"),  # what a batch recorded, rewritten, timed
    "executors": ("executors/", "coldstart.py", "nvrtc.py"),  # plan and run a graph on a device
    "runtime": ("device.py", "runner.py", "runtime.py", "export/"),  # execute, read back, export
    "front end": ("batch.py", "jit.py", "__init__.py"),  # GpuCommandBatch, jit and the package's names
    "models": (  # model files, decoders built from batch ops; a model exported as a web app
        "models/",
        "export/text_assets.py",
        "export/weight_sources.py",
        "export/chat_steps.py",
        "export/precision.py",
        "export/chat.py",
    ),
    "llm": ("llm/",),  # the serving engine and its HTTP server
    "tools": ("cli.py", "flags.py", "__main__.py", "check.py", "check_report.py", "overhead.py"),  # the command line
}


def _modules() -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(encoding="utf-8"))


def _defined_privates(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, module globals, ``self._x``, ``__slots__``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets):
                names.update(e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant))
    return {n for n in names if isinstance(n, str) and n.startswith("_") and not n.startswith("__")}


def _private_reads(tree: ast.Module) -> Iterator[tuple[int, str, str]]:
    """(line, attribute, expression) of every ``obj._name`` whose object is not self, cls or super()."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
            continue
        yield node.lineno, node.attr, ast.unparse(node)


def test_no_module_reads_another_modules_private_names() -> None:
    modules = list(_modules())
    defined = {path: _defined_privates(tree) for path, tree in modules}
    everywhere = set().union(*defined.values())
    crossings, unknown = [], []
    for path, tree in modules:
        name = path.relative_to(PACKAGE).as_posix()
        allowed = THIRD_PARTY_PRIVATES.get(name, set())
        for line, attribute, expression in _private_reads(tree):
            if attribute in defined[path] or attribute in allowed:
                continue  # the module's own private name (e.g. BatchView reading its batch in batch.py)
            where = f"{name}:{line}: {expression}"
            (crossings if attribute in everywhere else unknown).append(where)
    assert not crossings, "private names of other batchgpu modules read:\n" + "\n".join(crossings)
    assert not unknown, "new private names of other libraries (add them to THIRD_PARTY_PRIVATES):\n" + "\n".join(
        unknown
    )


def test_the_check_sees_a_crossing(tmp_path: Path) -> None:
    """The scan itself: a module reading another's private is caught (so the test above can fail)."""
    owner = ast.parse("class Batch:\n    def __init__(self):\n        self._recording = []\n")
    reader = ast.parse("def export(batch):\n    return batch._recording\n")
    assert "_recording" in _defined_privates(owner)
    assert "_recording" not in _defined_privates(reader)
    assert [attribute for _, attribute, _ in _private_reads(reader)] == ["_recording"]


def layer_of(name: str) -> int | None:
    """The index in ``LAYERS`` of the module ``name`` (its path under batchgpu/), None when it is unlisted."""
    found = [
        (len(path), index)
        for index, paths in enumerate(LAYERS.values())
        for path in paths
        if name == path or (path.endswith("/") and name.startswith(path))
    ]
    return max(found)[1] if found else None


def imported_modules(name: str, tree: ast.Module, modules: set[str]) -> Iterator[tuple[int, str]]:
    """(line, module path) of every module of ``modules`` that module ``name`` imports, wherever the import
    stands (top level, under ``TYPE_CHECKING``, inside a function): ``from .a import b`` imports ``a/b.py``
    where that is a module, else ``a.py`` or ``a/__init__.py``. Other libraries' modules are left out."""
    package = name.split("/")[:-1]

    def module(parts: list[str]) -> str | None:
        candidates = ("/".join(parts) + ".py", "/".join([*parts, "__init__.py"])) if parts else ("__init__.py",)
        return next((c for c in candidates if c in modules), None)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name.split(".")[1:] for a in node.names if a.name.split(".")[0] == "batchgpu"]
        elif isinstance(node, ast.ImportFrom):
            named = node.module.split(".") if node.module else []
            if node.level:
                parts = package[: len(package) - node.level + 1] + named
            elif named[:1] == ["batchgpu"]:
                parts = named[1:]
            else:
                continue
            targets = [[*parts, a.name] if module([*parts, a.name]) else parts for a in node.names]
        else:
            continue
        for parts in targets:
            found = module(parts)
            if found is not None and found != name:
                yield node.lineno, found


def import_graph() -> dict[str, dict[str, int]]:
    """Module path -> {imported module path: line of the first such import}, for every module of batchgpu."""
    trees = {path.relative_to(PACKAGE).as_posix(): tree for path, tree in _modules()}
    graph: dict[str, dict[str, int]] = {}
    for name, tree in trees.items():
        graph[name] = {}
        for line, target in imported_modules(name, tree, set(trees)):
            graph[name].setdefault(target, line)
    return graph


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Imports of a module from a higher layer than its own, as ``"a.py:3 (base) imports b.py (graph)"``."""
    names = list(LAYERS)
    found = []
    for name, targets in graph.items():
        for target, line in targets.items():
            low, high = layer_of(name), layer_of(target)
            if low is not None and high is not None and high > low:
                found.append(f"{name}:{line} ({names[low]}) imports {target} ({names[high]})")
    return found


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or through others (Tarjan's strongly
    connected components of more than one module), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for target in graph.get(name, {}):
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            group = stack[stack.index(name) :]
            del stack[stack.index(name) :]
            if len(group) > 1:
                cycles.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(cycles)


def test_every_module_sits_on_one_layer() -> None:
    modules = import_graph()
    unlisted = sorted(name for name in modules if layer_of(name) is None)
    assert not unlisted, "modules on no layer (add each to LAYERS in tests/test_structure.py):\n" + "\n".join(unlisted)
    unused = [
        path for paths in LAYERS.values() for path in paths if not any(n == path or n.startswith(path) for n in modules)
    ]
    assert not unused, f"LAYERS names paths that hold no module of batchgpu: {unused}"


def test_no_module_imports_from_a_higher_layer() -> None:
    upward = upward_imports(import_graph())
    assert not upward, "imports from a higher layer (declare a typing.Protocol below instead):\n" + "\n".join(upward)


def test_no_import_cycle() -> None:
    cycles = import_cycles(import_graph())
    assert not cycles, "modules importing each other:\n" + "\n".join(", ".join(group) for group in cycles)


def test_the_layer_check_sees_an_upward_import_and_a_cycle() -> None:
    """The scans themselves: an import under TYPE_CHECKING or in a function counts, and is caught."""
    modules = {"tensor.py", "batch.py", "ops/__init__.py", "ops/spec.py", "profiling.py"}
    tensor = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .batch import GpuCommandBatch\n")
    spec = ast.parse("def lower():\n    from .. import profiling\n    from batchgpu.ops import OPS\n")
    assert list(imported_modules("tensor.py", tensor, modules)) == [(3, "batch.py")]
    assert list(imported_modules("ops/spec.py", spec, modules)) == [(2, "profiling.py"), (3, "ops/__init__.py")]
    graph = {"tensor.py": {"batch.py": 3}, "batch.py": {"tensor.py": 1}, "ops/spec.py": {"tensor.py": 1}}
    assert upward_imports(graph) == ["tensor.py:3 (base) imports batch.py (front end)"]
    assert import_cycles(graph) == [["batch.py", "tensor.py"]]
    assert layer_of("ops/spec.py") == list(LAYERS).index("op specs") and layer_of("new.py") is None


KEPT_SYNC_NAMES: dict[str, dict[str, str]] = {
    "batch.py": {"GpuCommandBatch.read_sync": "the deprecated name of read, kept for one release (it warns)"},
    "runtime.py": {"Submission.read_sync": "the deprecated name of read, kept for one release (it warns)"},
    # the engine's public pair predates the rule (generate is its async iterator); renaming it changes the
    # serving API, so it comes with its own deprecation
    "llm/sync_calls.py": {"SyncCalls.generate_sync": "the engine's generate's blocking twin"},
}
"""The only ``*_sync`` names allowed, with the reason."""


def sync_async_violations(name: str, tree: ast.Module) -> Iterator[str]:
    """Where module ``name`` breaks the naming rule of sync/async pairs: ``x`` blocks, ``x_async`` awaits (an
    ``async def``, or a function returning a coroutine); a blocking function is never named ``x_sync``."""
    scopes: list[tuple[str, list[ast.stmt]]] = [("", tree.body)]
    scopes += [(f"{node.name}.", node.body) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    for prefix, body in scopes:
        functions = {f.name: f for f in body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for function_name, function in functions.items():
            qualified = prefix + function_name
            if function_name.endswith("_sync") and qualified not in KEPT_SYNC_NAMES.get(name, {}):
                yield f"{name}: {qualified} blocks: name it {function_name.removesuffix('_sync')}"
            if function_name + "_async" in functions and isinstance(function, ast.AsyncFunctionDef):
                yield f"{name}: {qualified} awaits beside {qualified}_async: the plain name blocks"
            returns = ast.unparse(function.returns) if function.returns is not None else ""
            awaits = isinstance(function, ast.AsyncFunctionDef) or "Coroutine" in returns or "Awaitable" in returns
            if function_name.endswith("_async") and not awaits:
                yield f"{name}: {qualified} does not return a coroutine"


def test_sync_async_pairs_follow_one_rule() -> None:
    """``read`` blocks and ``read_async`` awaits at every level: executors, runner, runtime, batch, Submission,
    Device."""
    found = [
        violation
        for path, tree in _modules()
        for violation in sync_async_violations(path.relative_to(PACKAGE).as_posix(), tree)
    ]
    assert not found, "sync/async names off the rule:\n" + "\n".join(found)


def test_the_naming_check_sees_a_coroutine_under_the_blocking_name() -> None:
    ticket = ast.parse("class Ticket:\n    def read_sync(self): ...\n    async def read(self): ...\n")
    device = ast.parse("class Device:\n    async def read(self): ...\n    def read_async(self) -> int: ...\n")
    assert list(sync_async_violations("runner.py", ticket)) == ["runner.py: Ticket.read_sync blocks: name it read"]
    assert list(sync_async_violations("device.py", device)) == [
        "device.py: Device.read awaits beside Device.read_async: the plain name blocks",
        "device.py: Device.read_async does not return a coroutine",
    ]
