"""A conversation in the exported chat app (``python -m batchgpu export-chat``) under Node, with the KV cache
kept across turns (``ChatModel.generate``'s ``reuse``, the default) and without it (``reuse: false``).

Each turn's prompt is the whole conversation so far, rendered by the model's chat template in JavaScript, as
the page's chat box sends it. With reuse a turn prefills only the ids after the longest common prefix with
what the cache holds (the last prompt and the reply's ids fed back); without, every earlier turn again. Per
round both conversations run in one Node process (one model load), in alternating order, each from an empty
cache (its first turn runs without reuse); per turn the report gives prompt tokens, the tokens prefilled with
and without reuse, the median wall time of the turn (prefill and the reply) over rounds, and whether both
conversations' ids are equal (greedy: they should be).

With ``--speculative K`` the two conversations are both with reuse, one decoding speculatively (prompt lookup, up
to K drafted ids a step: ``generate``'s ``speculative``) and one not, on a copy task by default (repeat a given
text: benchmarks/speculative.py's); per turn: the tokens, the decode tokens/s of each (median over rounds), the
verify steps, the drafted ids accepted, and whether the ids are equal (they should be).

    python benchmarks/chat_turns.py                                   # SmolLM2-135M, three turns, 16 tokens
    python benchmarks/chat_turns.py --model FILE.gguf --rounds 3 --max-tokens 32 --json out.json
    python benchmarks/chat_turns.py --speculative 4 --max-tokens 64   # the copy task, with and without
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MESSAGES = ("What is the capital of France?", "And of Italy?", "Which of the two is larger?")


def copy_messages() -> list[str]:
    """The copy task of benchmarks/speculative.py: the reply repeats a text of the prompt."""
    sys.path.insert(0, str(HERE))
    from speculative import TASKS

    return [message["content"] for message in TASKS["copy"]]


def run(
    model: Path,
    messages: list[str],
    max_tokens: int,
    rounds: int,
    max_context: int,
    chunk: int,
    speculative: int = 0,
) -> dict:
    """The conversations of every round, as benchmarks/chat_turns.mjs returns them: with and without reuse, or
    with ``speculative`` (K > 0) with and without speculative decoding."""
    from batchgpu.export.chat import export_chat
    from batchgpu.export.node import run_node

    if speculative:
        modes = [{"reuse": True, "speculative": speculative}, {"reuse": True, "speculative": None}]
    else:
        modes = [{"reuse": True}, {"reuse": False}]
    results = []
    with tempfile.TemporaryDirectory() as folder:
        shape = {"max_context": max_context, "chunk": chunk, "speculative_tokens": speculative}
        out = export_chat(model, Path(folder) / "app", gpu_kernels=False, **shape)
        (out / "chat_turns.mjs").write_text((HERE / "chat_turns.mjs").read_text(encoding="utf-8"), encoding="utf-8")
        for index in range(rounds):
            args = {"messages": messages, "maxTokens": max_tokens, "modes": modes if index % 2 == 0 else modes[::-1]}
            results.append(run_node("chat_turns.mjs", out, function="converse", args=args, timeout=3600))
    return {"rounds": results, "adapter": results[0]["adapter"]}


def turns_by(result: dict, mode: str) -> dict[bool, list[list[dict]]]:
    """Every round's conversations' turns, grouped by whether the conversation ran with ``mode`` on."""
    by_mode: dict[bool, list[list[dict]]] = {True: [], False: []}
    for round_ in result["rounds"]:
        for conversation in round_["conversations"]:
            by_mode[bool(conversation[mode])].append(conversation["turns"])
    return by_mode


def speculative_summary(result: dict) -> list[dict[str, Any]]:
    """Per turn: tokens, the median decode tokens/s with and without speculative decoding, the speculative run's
    verify steps, drafted and accepted ids, and whether the ids agree."""
    by_mode = turns_by(result, "speculative")
    rows = []
    for n, (fast, plain) in enumerate(zip(by_mode[True][0], by_mode[False][0]), 1):
        rate = {mode: statistics.median(turns[n - 1]["tokens_per_s"] for turns in by_mode[mode]) for mode in by_mode}
        rows.append(
            {
                "turn": n,
                "prompt_tokens": fast["prompt_tokens"],
                "generated": len(fast["token_ids"]),
                "tokens_per_s_speculative": rate[True],
                "tokens_per_s_plain": rate[False],
                "verify_steps": fast["verify_steps"],
                "drafted": fast["drafted"],
                "accepted": fast["accepted"],
                "same_ids": fast["token_ids"] == plain["token_ids"],
            }
        )
    return rows


def summary(result: dict) -> list[dict[str, Any]]:
    """Per turn: tokens and the median wall time with and without reuse, and whether the ids agree."""
    by_mode = turns_by(result, "reuse")
    rows = []
    for n, (kept, full) in enumerate(zip(by_mode[True][0], by_mode[False][0]), 1):
        wall = {mode: statistics.median(turns[n - 1]["wall_ms"] for turns in by_mode[mode]) for mode in by_mode}
        rows.append(
            {
                "turn": n,
                "prompt_tokens": kept["prompt_tokens"],
                "prefilled_reuse": kept["prefill_tokens"],
                "prefilled_full": full["prefill_tokens"],
                "generated": len(kept["token_ids"]),
                "wall_s_reuse": wall[True] / 1000,
                "wall_s_full": wall[False] / 1000,
                "same_ids": kept["prompt_ids"] == full["prompt_ids"] and kept["token_ids"] == full["token_ids"],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a GGUF chat model (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--message", action="append", help="a user turn (repeat; default: three questions)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-context", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--speculative", type=int, default=0, metavar="K", help="with and without speculative "
                        "decoding, up to K drafted ids a step (default messages: the copy task)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the raw results here")
    args = parser.parse_args(argv)
    if args.model is None:
        from batchgpu.models.llama import smollm2_path

        args.model = smollm2_path()
    messages = args.message or (copy_messages() if args.speculative else list(MESSAGES))
    shape = (args.max_tokens, args.rounds, args.max_context, args.chunk, args.speculative)
    result = run(args.model, messages, *shape)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1), encoding="utf-8")
    if args.speculative:
        print(f"{args.model.name} on {result['adapter']}, {args.rounds} round(s), speculative {args.speculative}")
        print("turn  prompt  generated  tokens/s (speculative / plain)  verify steps  accepted / drafted  same ids")
        for row in speculative_summary(result):
            print(
                f"{row['turn']:>4}  {row['prompt_tokens']:>6}  {row['generated']:>9}  "
                f"{row['tokens_per_s_speculative']:>12.1f} / {row['tokens_per_s_plain']:<13.1f}  "
                f"{row['verify_steps']:>12}  {row['accepted']:>8} / {row['drafted']:<7}  {row['same_ids']}"
            )
        return 0
    print(f"{args.model.name} on {result['adapter']}, {args.rounds} round(s), median wall time per turn")
    print("turn  prompt  prefilled (reuse / full)  generated  wall s (reuse / full)  same ids")
    for row in summary(result):
        print(
            f"{row['turn']:>4}  {row['prompt_tokens']:>6}  {row['prefilled_reuse']:>9} / {row['prefilled_full']:<12}"
            f"  {row['generated']:>9}  {row['wall_s_reuse']:>8.2f} / {row['wall_s_full']:<10.2f}  {row['same_ids']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
