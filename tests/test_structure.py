"""The package's seams hold: no module of batchgpu reads a private name (``obj._name``) that another module
of batchgpu defines. Each module reaches the others through their public names (the batch through
``GpuCommandBatch.view()``, executors through their protocol and public helpers).

Private names of other libraries that batchgpu has to use are listed per module in
``THIRD_PARTY_PRIVATES`` with the reason, so a new one is a deliberate decision."""

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
