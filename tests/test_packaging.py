"""The wheel ships a ``py.typed`` marker: a user's type checker sees batchgpu's annotations.

The test builds the wheel, installs it alone into a fresh virtual environment (numpy reached through a
``.pth`` file, so the editable checkout is not on that environment's path) and runs mypy on small user
scripts against it: a correct script passes, a wrong one fails on batchgpu's own types, and the same
correct script fails once the marker is removed from the installed package (so the test can fail).
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

USER_SCRIPT = """
import numpy as np
import batchgpu as bg

dev = bg.Device("reference")
batch = bg.GpuCommandBatch(dev)
x = batch.upload(np.ones((2, 3), np.float32))
y: bg.Tensor = batch.relu(batch.matmul(x, dev.tensor(np.ones((3, 4), np.float32))))
batch.execute()
out: np.ndarray = batch.read_sync(y)
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


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(python of a fresh environment holding only the built wheel, that environment's site-packages)."""
    pytest.importorskip("mypy", reason="mypy is part of the test extra")
    root = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(root), str(ROOT)],
        check=True,
        timeout=300,
    )
    (wheel,) = root.glob("batchgpu-*.whl")
    env = root / "env"
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
