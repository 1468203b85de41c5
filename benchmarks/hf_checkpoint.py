"""SmolLM2-135M from a Hugging Face directory against the same model from its GGUF file: the GGUF's weights
are written once as a transformers-layout checkpoint (``config.json``, float16 safetensors in shards,
``tokenizer.json``), then each source is loaded in a fresh process: load seconds, the process's peak
resident memory growth while loading (against the checkpoint, its largest shard and the device's weight
bytes), decode ms/token and greedy ids (the float16 directory and the Q4_1 file are different roundings
of one model, so their ids may part late; each must start with the published " Paris.").

    python benchmarks/hf_checkpoint.py [--device wgpu,reference] [--shards 3] [--tokens 16]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parent))
from torch_llama import hf_state_dict

from batchgpu.models.llama import GGUFWeights, smollm2_path

PROMPT = "The capital of France is"


def write_checkpoint(directory: Path, shards: int) -> None:
    """SmolLM2's GGUF weights (dequantized, q/k rows un-permuted) as float16 safetensors shards."""
    from safetensors.numpy import save_file

    weights = GGUFWeights(smollm2_path())
    cfg = weights.config
    state = {name: array.astype(np.float16) for name, array in hf_state_dict(weights).items()}
    names = sorted(state)
    index = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        save_file({name: state[name] for name in names[shard::shards]}, str(directory / file))
        index.update(dict.fromkeys(names[shard::shards], file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    config = dict(
        model_type="llama", hidden_size=cfg.hidden, intermediate_size=cfg.ffn, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, vocab_size=cfg.vocab, rms_norm_eps=cfg.eps,
        rope_theta=cfg.theta, max_position_embeddings=cfg.context, tie_word_embeddings=True, eos_token_id=2,
    )  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    codec = weights.codec()
    codec.tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": codec.chat_template}))


def peak_rss() -> int:
    """This process's peak resident bytes: Linux's VmHWM (ru_maxrss would count the parent's pages, which
    a child started by fork and exec inherits), else ru_maxrss."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(source: str, device: str, tokens: int) -> dict:
    """Load ``source`` on ``device`` in this process and decode; the figures as a dict."""
    import batchgpu as bg
    from batchgpu.models.llama import Llama

    dev = bg.Device(device)
    before = peak_rss()
    started = time.perf_counter()
    model = Llama(dev, source, max_context=64, progress=lambda names: names)
    load = time.perf_counter() - started
    peak = peak_rss() - before
    codec = model.weights.codec()
    ids = codec.encode(PROMPT)
    stamps, out = [], []
    for token in model.generate(ids, tokens):
        stamps.append(time.perf_counter())
        out.append(token)
    gaps = np.diff(stamps[2:])
    weight_bytes = sum(t.nbytes for t in model.params.values())
    return dict(load_s=load, peak_growth=peak, ms_per_token=float(np.median(gaps)) * 1e3,
                text=codec.decode(out), weight_bytes=weight_bytes)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="wgpu,reference")
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)  # internal: source device
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure, args.tokens)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        write_checkpoint(directory, args.shards)
        files = list(directory.glob("*.safetensors"))
        total, largest = sum(f.stat().st_size for f in files), max(f.stat().st_size for f in files)
        stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
        print(
            f"date: {stamp}; float16 checkpoint {total / 1e6:.0f} MB in {len(files)} shards "
            f"(largest {largest / 1e6:.0f} MB); GGUF Q4_1 {smollm2_path().stat().st_size / 1e6:.0f} MB\n"
        )
        print("| device | source | load s | peak RSS growth MB | device weight MB | ms/token | text |")
        print("|---|---|---:|---:|---:|---:|---|")
        for device in args.device.split(","):
            for label, source in (("GGUF Q4_1", str(smollm2_path())), ("HF dir float16", str(directory))):
                command = [sys.executable, __file__, "--tokens", str(args.tokens), "--measure", source, device]
                row = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
                print(
                    f"| {device} | {label} | {row['load_s']:.2f} | {row['peak_growth'] / 1e6:.0f} | "
                    f"{row['weight_bytes'] / 1e6:.0f} | {row['ms_per_token']:.1f} | {row['text'][:40]!r} |"
                )


if __name__ == "__main__":
    main()
