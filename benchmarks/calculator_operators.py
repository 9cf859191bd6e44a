"""Which operator does a calculator policy write? Held-out accuracy split by the question's operator.

``python benchmarks/calculator_operators.py NAME=CHECKPOINT ... [--seeds 0 1] [--out FILE]``

Runs on the machine that calls it (``otray infer`` per checkpoint, a local Ray each time). For each checkpoint (a
``<job dir>/checkpoints/step-N`` or a model dir) it decodes the calculator eval split greedily once and sampled
once per seed, and reports per operator of the question (``+`` / ``-``): the accuracy, how often the tool call
copied the expression exactly, and how often the call wrote ``+``. A policy that writes the same operator whatever
the question says scores about the share of that operator's questions greedily, and its greedy score swings a
whole class when RL moves that one token's preference (issue 55, ``docs/notes/learning.md``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from results_io import RESULTS, save  # noqa: E402

QUESTION = re.compile(r"What is (.*)\?")
CALL = re.compile(r'"expression": "([^"]*)"')


def decode(checkpoint: str, sample: bool, seed: int, limit: int, out: Path) -> list[dict]:
    """The eval split's episodes from one ``otray infer`` run."""
    cmd = [str(ROOT / ".venv" / "bin" / "otray"), "infer", str(ROOT / "conf" / "calculator.yaml"), f"job.seed={seed}",
           "--checkpoint", checkpoint, "--limit", str(limit), "--sample" if sample else "--no-sample", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def by_operator(episodes: list[dict]) -> dict:
    """Accuracy, exact tool-call copies and calls written with ``+``, per operator of the question."""
    out: dict = {"episodes": len(episodes), "accuracy": sum(e["reward"] for e in episodes) / max(1, len(episodes))}
    for op in "+-":
        mine = [e for e in episodes if op in QUESTION.search(e["prompt"]).group(1)]
        calls = [CALL.search(next((m["content"] for m in e["messages"] if m["role"] == "assistant"), "")) for e in mine]
        asked = [QUESTION.search(e["prompt"]).group(1) for e in mine]
        n = max(1, len(mine))
        out[op] = {"questions": len(mine), "accuracy": round(sum(e["reward"] for e in mine) / n, 3),
                   "copied": round(sum(c is not None and c.group(1) == a for c, a in zip(calls, asked)) / n, 3),
                   "wrote_plus": round(sum(c is not None and "+" in c.group(1) for c in calls) / n, 3)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+", help="NAME=PATH (a checkpoint or model dir)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="one sampled pass per seed")
    parser.add_argument("--limit", type=int, default=300, help="eval tasks (the split holds 300)")
    parser.add_argument("--out", type=Path, default=RESULTS / "calculator_operators.json")
    args = parser.parse_args()
    result: dict = {"limit": args.limit, "seeds": args.seeds, "checkpoints": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for item in args.checkpoints:
            name, _, path = item.partition("=")
            if not path:
                raise SystemExit(f"{item!r}: give NAME=PATH (e.g. warmup=runs/x/checkpoints/step-000000)")
            greedy = by_operator(decode(path, False, 0, args.limit, Path(tmp) / f"{name}_greedy.jsonl"))
            sampled = by_operator([e for s in args.seeds
                                   for e in decode(path, True, s, args.limit, Path(tmp) / f"{name}_{s}.jsonl")])
            result["checkpoints"][name] = {"path": path, "greedy": greedy, "sampled": sampled}
            print(f"{name}: greedy {greedy['accuracy']:.3f} (+ {greedy['+']['accuracy']:.3f}, "
                  f"- {greedy['-']['accuracy']:.3f}; wrote + on - questions {greedy['-']['wrote_plus']:.3f}), "
                  f"sampled {sampled['accuracy']:.3f} (wrote + on +/- questions {sampled['+']['wrote_plus']:.3f} / "
                  f"{sampled['-']['wrote_plus']:.3f})", flush=True)
    save(result, args.out)


if __name__ == "__main__":
    main()
