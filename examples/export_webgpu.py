"""Export the FFN example as a standalone WebGPU program and (optionally) run it in headless Chromium.

python examples/export_webgpu.py out/ffn-webgpu              # then: python -m http.server -d out/ffn-webgpu
python examples/export_webgpu.py out/ffn-webgpu --headless   # run it in chromium, print the result table
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import batchgpu as bg
from batchgpu.export.browser import format_result, run_page

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ffn_layer import make_weights, record_ffn


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=344)
    parser.add_argument("--headless", action="store_true", help="run the export in headless Chromium")
    args = parser.parse_args()

    dev = bg.Device()
    rng = np.random.default_rng(0)
    weights = [
        {name: dev.tensor(w, name=f"l{i}.{name}") for name, w in layer.items()}
        for i, layer in enumerate(make_weights(rng, args.layers, args.hidden, args.ffn))
    ]
    batch = bg.GpuCommandBatch(dev, name="ffn")
    x = batch.upload(rng.standard_normal((args.tokens, args.hidden)).astype(np.float32), name="x")
    record_ffn(batch, x, weights)
    out = batch.export_webgpu(args.out_dir)
    print(f"exported {len(batch)} ops to {out}")
    if not args.headless:
        print(f"open it: python -m http.server -d {out} 8000, then http://localhost:8000/ in a WebGPU browser")
        return 0
    result = run_page(out, "index.html?runs=10", timeout=300)
    print(format_result(result))
    return 0 if result.get("status") == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
