"""Run an exported WebGPU program under Node: WebGPU from the npm package ``webgpu`` (Dawn's Node bindings).

    result = run_node("batch.js", out_dir, function="check")   # the export's own check, as JSON

``webgpu_package()`` finds the package (pinned to ``WEBGPU_VERSION``) in ``$BATCHGPU_NODE_MODULES`` or
``~/.cache/batchgpu/node/``, installing it there with ``npm install`` the first time (a ~51 MB download,
not into the project). ``run_node`` imports an ES module of the exported folder in a fresh Node process
and awaits one of its functions, ``fn(baseUrl, args)``; there ``navigator.gpu`` is the package's GPU, as
``getGpu()`` of the export's ``node_gpu.js`` also gives it (which, run by plain ``node``, imports the
package itself: see that file).

Dawn's Vulkan backend refuses Mesa 22's lavapipe (it lacks ``shaderSampledImageArrayDynamicIndexing``),
so where Chromium is installed its SwiftShader Vulkan driver is offered to the Vulkan loader as well
(``VK_ADD_DRIVER_FILES``, unless a ``VK_*`` variable already chooses the drivers): the software adapter
the browser tests run on. Dawn's default adapter order puts GPUs before such fallback (CPU) adapters;
``flags=["adapter=NAME"]`` picks one by name.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

WEBGPU_PACKAGE = "webgpu"
WEBGPU_VERSION = "0.6.2"
ENV_NODE = "BATCHGPU_NODE"
ENV_NODE_MODULES = "BATCHGPU_NODE_MODULES"
DEFAULT_NODE_MODULES = Path.home() / ".cache" / "batchgpu" / "node"
NODE_NAMES = ("node", "nodejs")
MIN_NODE_MAJOR = 18
SWIFTSHADER_ICD = "vk_swiftshader_icd.json"
SWIFTSHADER_DIRS = ("/usr/lib/chromium", "/usr/lib64/chromium", "/usr/lib/chromium-browser", "/opt/google/chrome")
"""Where Chromium packages keep SwiftShader's Vulkan driver (Debian's chromium, Fedora's, Ubuntu's, Chrome)."""
VULKAN_DRIVER_VARIABLES = ("VK_ICD_FILENAMES", "VK_DRIVER_FILES", "VK_ADD_DRIVER_FILES")


class NodeError(RuntimeError):
    """A Node run failed: the module threw, timed out, or printed no JSON result."""


class NodeUnavailableError(NodeError):
    """Node, npm or the ``webgpu`` package is missing and cannot be installed (no npm, no network)."""


def find_node() -> str | None:
    """``$BATCHGPU_NODE`` or the first ``node`` on PATH."""
    configured = os.environ.get(ENV_NODE)
    if configured:
        return shutil.which(configured) or (configured if os.path.isfile(configured) else None)
    return next((found for name in NODE_NAMES if (found := shutil.which(name))), None)


def node_modules_dir() -> Path:
    """The folder the ``webgpu`` package is installed into: ``$BATCHGPU_NODE_MODULES`` or the user cache."""
    configured = os.environ.get(ENV_NODE_MODULES)
    return Path(configured).expanduser() if configured else DEFAULT_NODE_MODULES


def webgpu_package(*, install: bool = True, timeout: float = 900.0) -> Path:
    """The ``webgpu`` package's entry module (``.../node_modules/webgpu/index.js``), version
    ``WEBGPU_VERSION``; installed with npm into :func:`node_modules_dir` when missing and ``install``.

    Raises :class:`NodeUnavailableError` when it is missing and cannot be installed."""
    prefix = node_modules_dir()
    if _installed_version(prefix) == WEBGPU_VERSION:
        return _entry(prefix)
    if not install:
        raise NodeUnavailableError(f"the npm package {WEBGPU_PACKAGE}@{WEBGPU_VERSION} is not installed in {prefix}")
    npm = shutil.which("npm")
    if npm is None:
        raise NodeUnavailableError(
            f"npm is not installed (apt-get install -y nodejs npm): it installs the npm package "
            f"{WEBGPU_PACKAGE}@{WEBGPU_VERSION} that runs WebGPU under Node"
        )
    prefix.mkdir(parents=True, exist_ok=True)
    with _locked(prefix / ".install.lock"):  # one install at a time (test workers share the folder)
        if _installed_version(prefix) != WEBGPU_VERSION:
            _npm_install(npm, prefix, timeout)
    return _entry(prefix)


def _entry(prefix: Path) -> Path:
    return prefix / "node_modules" / WEBGPU_PACKAGE / "index.js"


def _installed_version(prefix: Path) -> str | None:
    try:
        manifest = json.loads((prefix / "node_modules" / WEBGPU_PACKAGE / "package.json").read_text())
    except (OSError, ValueError):
        return None
    return manifest.get("version") if _entry(prefix).is_file() else None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _npm_install(npm: str, prefix: Path, timeout: float) -> None:
    # --ignore-scripts: the package's only script clears macOS's quarantine flag on its binary
    command = [npm, "install", "--prefix", str(prefix), "--no-save", "--ignore-scripts", "--no-audit", "--no-fund"]
    command.append(f"{WEBGPU_PACKAGE}@{WEBGPU_VERSION}")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as error:
        raise NodeUnavailableError(f"npm install {WEBGPU_PACKAGE}@{WEBGPU_VERSION} took over {timeout:g} s") from error
    if done.returncode != 0 or _installed_version(prefix) != WEBGPU_VERSION:
        raise NodeUnavailableError(
            f"npm install {WEBGPU_PACKAGE}@{WEBGPU_VERSION} into {prefix} failed (exit {done.returncode}; no network "
            f"or registry?): {(done.stderr or done.stdout).strip()[-2000:]}"
        )


def software_vulkan_driver() -> Path | None:
    """Chromium's SwiftShader Vulkan driver manifest (``vk_swiftshader_icd.json``), if installed."""
    chromium = next((found for name in ("chromium", "chromium-browser") if (found := shutil.which(name))), None)
    folders = [Path(chromium).resolve().parent] if chromium else []
    folders += [Path(folder) for folder in SWIFTSHADER_DIRS]
    return next((folder / SWIFTSHADER_ICD for folder in folders if (folder / SWIFTSHADER_ICD).is_file()), None)


def node_environment(flags: Sequence[str] = ()) -> dict[str, str]:
    """The environment ``run_node`` gives Node: this one, plus where ``node_gpu.js`` imports the package
    from, Dawn's ``flags``, and SwiftShader offered to the Vulkan loader unless a driver is already chosen."""
    environment = dict(os.environ)
    environment["BATCHGPU_WEBGPU"] = webgpu_package().as_uri()
    environment["BATCHGPU_WEBGPU_FLAGS"] = json.dumps([str(flag) for flag in flags])
    driver = software_vulkan_driver()
    if driver is not None and not any(environment.get(name) for name in VULKAN_DRIVER_VARIABLES):
        environment["VK_ADD_DRIVER_FILES"] = str(driver)
    return environment


def _checked_node() -> str:
    node = find_node()
    if node is None:
        raise NodeUnavailableError(f"Node.js is not installed (apt-get install -y nodejs; or set ${ENV_NODE})")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    major = version.strip().lstrip("v").split(".")[0]
    if not major.isdigit() or int(major) < MIN_NODE_MAJOR:
        raise NodeUnavailableError(f"{node} is Node {version.strip() or '?'}; running WebGPU needs Node >= 18")
    return node


def run_node(
    module: str | Path,
    base_dir: str | Path,
    *,
    function: str = "default",
    args: Mapping[str, Any] | None = None,
    flags: Sequence[str] = (),
    timeout: float = 120.0,
) -> Any:
    """Import the ES module ``module`` (a path, relative to ``base_dir`` unless absolute) in a new Node
    process, await ``module[function](baseUrl, args)`` there and return its result, which Node prints as
    the last line of its stdout, decoded from JSON; ``navigator.gpu`` is the ``webgpu`` package's GPU there.
    ``baseUrl`` is the ``file:`` URL of ``base_dir`` (ending in ``/``), which the export's modules read
    their files from; ``args`` must be JSON; ``flags`` are Dawn's options (``"backend=vulkan"``,
    ``"adapter=NAME"``, ``"enable-dawn-features=..."``).

    Raises :class:`NodeUnavailableError` without Node or the ``webgpu`` package, and :class:`NodeError`
    (with Node's stderr) when the function throws or Node runs past ``timeout`` seconds."""
    return _run(module, base_dir, function, args, flags, timeout)[0]


def _run(
    module: str | Path,
    base_dir: str | Path,
    function: str,
    args: Mapping[str, Any] | None,
    flags: Sequence[str],
    timeout: float,
) -> tuple[Any, str]:
    """``run_node``'s result and Node's stderr."""
    base = Path(base_dir).resolve()
    path = Path(module) if Path(module).is_absolute() else base / module
    if not path.is_file():
        raise NodeError(f"run_node: no module {path}")
    node = _checked_node()
    environment = node_environment(flags)
    main = resources.files("batchgpu.export") / "node_main.mjs"
    command = [node, str(main), path.resolve().as_uri(), function, base.as_uri() + "/", json.dumps(dict(args or {}))]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment, check=False)
    except subprocess.TimeoutExpired as error:
        stderr = error.stderr.decode(errors="replace") if isinstance(error.stderr, bytes) else error.stderr or ""
        message = f"run_node: {path.name} {function}() ran past {timeout:g} s; stderr: {stderr[-2000:]}"
        raise NodeError(message) from error
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise NodeError(
            f"run_node: {path.name} {function}() failed (exit {done.returncode}): {done.stderr.strip()[-4000:]}"
        )
    try:
        return json.loads(lines[-1]), done.stderr
    except ValueError as error:
        raise NodeError(f"run_node: {path.name} {function}() printed no JSON result: {lines[-1][:500]!r}") from error


def node_adapter(*, flags: Sequence[str] = (), timeout: float = 60.0) -> dict[str, Any]:
    """The WebGPU adapter Node gets (``describeAdapter()`` of node_gpu.js: vendor, architecture, device,
    description, isFallbackAdapter, features, limits). Raises :class:`NodeUnavailableError` where Node,
    the package or an adapter is missing (Dawn's reasons, e.g. a Vulkan driver it refuses, in the message)."""
    app = Path(str(resources.files("batchgpu.export") / "app"))
    adapter, stderr = _run("node_gpu.js", app, "describeAdapter", None, flags, timeout)
    if not adapter:
        raise NodeUnavailableError(
            f"Node's WebGPU (npm {WEBGPU_PACKAGE}@{WEBGPU_VERSION}, Dawn) found no adapter; Dawn said: "
            f"{stderr.strip()[-2000:] or 'nothing'}"
        )
    return adapter
