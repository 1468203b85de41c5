"""The wheel: its metadata and what runs from it without the source checkout.

The tests build the wheel once and install it alone into a fresh virtual environment (numpy, and wgpu
beside it, reached through a ``.pth`` file, so the editable checkout is not on that environment's path).

- It ships a ``py.typed`` marker: mypy runs on small user scripts against it, a correct script passes, a
  wrong one fails on batchgpu's own types, and the same correct script fails once the marker is removed
  from the installed package (so the test can fail).
- Its ``.dist-info`` holds the Apache-2.0 LICENSE and the ``batchgpu`` console script, which runs from
  the installed wheel, ``bench`` included (whose decode benchmark needs the checkout's benchmarks/).
"""

from __future__ import annotations

import configparser
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import numpy as np
import pytest

import batchgpu

ROOT = Path(__file__).resolve().parents[1]

USER_SCRIPT = """
import numpy as np
import batchgpu as bg

dev = bg.Device("reference")
batch = bg.GpuCommandBatch(dev)
x = batch.upload(np.ones((2, 3), np.float32))
y: bg.Tensor = batch.relu(batch.matmul(x, dev.tensor(np.ones((3, 4), np.float32))))
batch.execute()
out: np.ndarray = batch.read(y)
shape: tuple[int, ...] = y.shape
"""

WRONG_SCRIPT = """
import batchgpu as bg

batch = bg.GpuCommandBatch(bg.Device("reference"))
count: int = batch.scalar("pos")
"""


def _mypy(python: Path, script: Path, cache: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mypy", "--python-executable", str(python), "--cache-dir", str(cache), str(script)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=script.parent)


ENTRY_POINT = """
import sys
from importlib.metadata import entry_points

(script,) = entry_points(group="console_scripts", name="batchgpu")
sys.exit(script.load()(sys.argv[1:]))  # what the installed batchgpu script does
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from the checkout."""
    root = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(root), str(ROOT)],
        check=True,
        timeout=300,
    )
    (built,) = root.glob("batchgpu-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path) -> tuple[Path, Path]:
    """(python of a fresh environment holding only the built wheel, that environment's site-packages)."""
    env = wheel.parent / "env"
    venv.create(env, with_pip=False)
    python = env / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    site = Path(purelib)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True,
        timeout=300,
    )
    (site / "host_numpy.pth").write_text(str(Path(np.__file__).parents[1]) + "\n")
    assert sysconfig.get_paths()["purelib"] != purelib
    return python, site


def test_wheel_ships_py_typed_and_mypy_checks_user_code(installed: tuple[Path, Path], tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy is part of the test extra")
    python, site = installed
    found = subprocess.run(
        [str(python), "-c", "import batchgpu; print(batchgpu.__file__)"], capture_output=True, text=True, cwd=tmp_path
    )
    assert found.stdout.startswith(str(site)), found  # the wheel, not the editable checkout
    assert (site / "batchgpu" / "py.typed").is_file()
    good, wrong = tmp_path / "user.py", tmp_path / "wrong.py"
    good.write_text(USER_SCRIPT)
    wrong.write_text(WRONG_SCRIPT)
    passed = _mypy(python, good, tmp_path / "cache")
    assert passed.returncode == 0, passed.stdout + passed.stderr
    failed = _mypy(python, wrong, tmp_path / "cache")
    assert failed.returncode == 1 and 'expression has type "Scalar", variable has type "int"' in failed.stdout, failed
    (site / "batchgpu" / "py.typed").unlink()  # control: without the marker mypy cannot use the package
    untyped = _mypy(python, good, tmp_path / "cache-untyped")
    assert untyped.returncode == 1 and "py.typed" in untyped.stdout, untyped.stdout


def test_wheel_metadata_has_the_license_and_the_console_script(wheel: Path) -> None:
    dist_info = f"batchgpu-{batchgpu.__version__}.dist-info/"
    with zipfile.ZipFile(wheel) as archive:
        (license_file,) = [n for n in archive.namelist() if n.startswith(dist_info) and n.endswith("/LICENSE")]
        license_text = archive.read(license_file).decode()
        metadata = archive.read(dist_info + "METADATA").decode()
        entry_points = configparser.ConfigParser()
        entry_points.read_string(archive.read(dist_info + "entry_points.txt").decode())
    assert license_text == (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "License: Apache-2.0" in metadata.splitlines() and "License-File: LICENSE" in metadata.splitlines()
    assert entry_points["console_scripts"]["batchgpu"] == "batchgpu.cli:main"


def test_console_script_runs_from_the_wheel_without_the_checkout(installed: tuple[Path, Path], tmp_path: Path) -> None:
    python, site = installed

    def batchgpu_script(*args: str) -> subprocess.CompletedProcess:
        command = [str(python), "-c", ENTRY_POINT, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=tmp_path)

    version = batchgpu_script("--version")
    assert version.returncode == 0 and version.stdout == f"batchgpu {batchgpu.__version__}\n", version
    bench = batchgpu_script("bench", "--ops", "10", "--repeat", "1", "--plot", "")
    assert bench.returncode == 0, bench.stdout + bench.stderr
    assert "| ops | batched ms |" in bench.stdout  # the overhead sweep ships in the package
    (skipped,) = [line for line in bench.stdout.splitlines() if line.startswith("decode benchmark skipped")]
    assert str(site / "benchmarks") in skipped  # no benchmarks/ beside the installed package
