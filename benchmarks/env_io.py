"""Concurrent env I/O in the agent loop: 32 OpenReward episodes of 3 tool calls (200 ms each), one
episode alone, all 32 one call at a time (``max_concurrency: 1``), and all 32 side by side
(``max_concurrency: 32``), against the SDK's own server on localhost.

Generation is scripted (every reply is the tool call), so the figures are env time only: the
server (``tests/fixtures/openreward_envs.py``: ``Slow``), the SDK's HTTP sessions, otray's adapter and loop.
Target (issue "Environments over the network"): 32 concurrent episodes in < 2x one episode.

    python benchmarks/env_io.py [--episodes 32] [--rounds 3]

Prints a table and saves ``benchmarks/results/env_io.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from envs.openreward import OpenRewardEnv
    from otray.actors.rollout.agent_loop import AgentLoop, Limits
    from otray.actors.rollout.env_io import EnvIO
    from otray.models import end_of_turn_ids, load_tokenizer, resolve_model_path
    from otray.types import FinishReason, GenerateResult, Sample, SamplingParams, Task
    from tests.fixtures.openreward_envs import SLOW_S

    tokenizer = load_tokenizer(resolve_model_path("tiny", ROOT / ".cache" / "models"))
    reply = tokenizer.encode('<tool_call>{"name": "wait", "arguments": {}}</tool_call>', add_special_tokens=False)
    reply += [end_of_turn_ids(tokenizer)[0]]

    def generate(prompts, params, n):
        return [GenerateResult([Sample(reply, [0.0] * len(reply), FinishReason.STOP)], 0) for _ in prompts]

    from envs.openreward import start_server

    proc, url = start_server("tests.fixtures.openreward_envs", cwd=ROOT)
    try:
        def run(n: int, concurrency: int) -> float:
            limits = Limits(max_turns=3, max_tokens_per_turn=32, max_tokens_per_episode=96, max_model_len=512,
                            env_io=EnvIO(max_concurrency=concurrency, timeout_s=30))
            eps = [(Task(f"train-{i}", "slow", {"split": "train", "index": i % 20}), OpenRewardEnv("Slow", url, "Slow"), i)
                   for i in range(n)]
            t0 = time.perf_counter()
            trajs = AgentLoop(tokenizer, generate, limits).run_many([(eps, SamplingParams(max_tokens=32), limits)])
            took = time.perf_counter() - t0
            bad = [t.error for t in trajs if t.error is not None or t.turn_rewards != [None, None, 1.0]]
            if bad:
                raise RuntimeError(f"episodes did not run as scripted: {bad[:2]}")
            return took

        run(1, 1)  # warm: the SDK's client and event loop
        cells = {"one_episode": (1, 1), "serial": (args.episodes, 1), "concurrent": (args.episodes, args.episodes)}
        times = {name: [run(n, c) for _ in range(args.rounds)] for name, (n, c) in cells.items()}
    finally:
        proc.terminate()
        proc.wait(10)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"episodes": args.episodes, "tool_calls_per_episode": 3, "tool_s": SLOW_S, "rounds": args.rounds,
              "seconds": times, "median_s": med, "concurrent_over_one_episode": med["concurrent"] / med["one_episode"],
              "serial_over_concurrent": med["serial"] / med["concurrent"], "target": "concurrent < 2x one episode",
              "met": med["concurrent"] < 2 * med["one_episode"]}
    print(f"{'case':<14}{'median s':>10}")
    for k, v in med.items():
        print(f"{k:<14}{v:>10.2f}")
    print(f"concurrent / one episode: {result['concurrent_over_one_episode']:.2f} (target < 2: "
          f"{'met' if result['met'] else 'MISSED'}); serial / concurrent: {result['serial_over_concurrent']:.1f}")
    out = ROOT / "benchmarks" / "results" / "env_io.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
