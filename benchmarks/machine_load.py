"""The machine's load, printed beside every benchmark figure and written into the JSON outputs: the
hosts are shared, and a figure taken under load says as much about the other jobs as about the code.

Imported by the scripts beside it (``python benchmarks/<name>.py`` puts this folder on ``sys.path``;
modules loaded by path append it themselves).
"""

from __future__ import annotations

import math
import os


def load_average() -> float:
    """The machine's 1-minute load average (NaN where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return math.nan
