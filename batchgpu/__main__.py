"""``python -m batchgpu info | bench | profile SCRIPT | serve`` (the ``batchgpu`` console script's twin):
see :mod:`batchgpu.cli`."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
