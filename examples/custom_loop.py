"""A GRPO loop written with otray's local training primitives (no TrainJob, no ResourceManager).

    python examples/custom_loop.py [--steps 20] [--sft-steps 300]

SFT warm-up, then GRPO on 2-digit addition, printing greedy accuracy on held-out
problems before and after. Everything below is the public API of ``otray.local``
(``TrainingClient.for_model``, ``forward_backward``, ``optim_step``, ``sampling_client``,
``sample``): actors on a local Ray, for a cluster you own. On a shared one, use ``otray tinker``
and the ``tinker`` SDK (``examples/tinker_rl_loop.py``).
"""

from __future__ import annotations

import argparse
import os
import random

import ray
from envs.arithmetic import make_problems, parse_answer
from otray.algos.advantages import group_zscore
from otray.algos.datums import sft_datum, trajectory_to_datum
from otray.local import TrainingClient
from otray.models import chat_prompt_ids, load_tokenizer
from otray.types import SamplingParams, Task, Trajectory


def accuracy(sampler, tok, problems) -> float:
    prompts = [chat_prompt_ids(tok, [{"role": "user", "content": p["question"]}]) for p in problems]
    out = sampler.sample(prompts, SamplingParams(max_tokens=6, temperature=0.0), 1)
    texts = [tok.decode(r.samples[0].token_ids, skip_special_tokens=True) for r in out]
    return sum(parse_answer(t) == p["answer"] for t, p in zip(texts, problems)) / len(problems)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--group", type=int, default=8)
    args = ap.parse_args()

    ray.init(address=os.environ.get("RAY_ADDRESS", "local"), include_dashboard=False, log_to_driver=False)
    tc = TrainingClient.for_model("tiny", lora_rank=0)
    tok = load_tokenizer(tc.model_path)
    problems = make_problems(0)
    held_out, train = problems[:100], problems[500:]
    rng = random.Random(0)
    prompt = lambda p: chat_prompt_ids(tok, [{"role": "user", "content": p["question"]}])  # noqa: E731

    for step in range(args.sft_steps):  # SFT warm-up
        batch = [sft_datum(prompt(p), tok.encode(str(p["answer"]), add_special_tokens=False) + [tok.eos_token_id])
                 for p in rng.sample(train, 64)]
        tc.forward_backward(batch, "cross_entropy")
        tc.optim_step(learning_rate=2e-3 * min(1.0, (step + 1) / 50))
    sampler = tc.sampling_client()
    print(f"after SFT: held-out accuracy {accuracy(sampler, tok, held_out):.3f}")

    for step in range(args.steps):  # GRPO
        tasks = rng.sample(train, 16)
        results = sampler.sample([prompt(p) for p in tasks], SamplingParams(max_tokens=6, temperature=1.0), args.group)
        datums = []
        for p, res in zip(tasks, results):
            rewards = [float(parse_answer(tok.decode(s.token_ids, skip_special_tokens=True)) == p["answer"])
                       for s in res.samples]
            for s, adv in zip(res.samples, group_zscore(rewards)):
                traj = Trajectory(task=Task(p["id"], "arithmetic"))
                traj.append(prompt(p), sampled=False)
                traj.append(s.token_ids, sampled=True, logprobs=s.logprobs)
                datums.append(trajectory_to_datum(traj, adv))
        tc.forward_backward(datums, "ppo")
        tc.optim_step(learning_rate=5e-4)
        sampler.update(tc.learner.weights.remote())
    print(f"after {args.steps} GRPO steps: held-out accuracy {accuracy(sampler, tok, held_out):.3f}")


if __name__ == "__main__":
    main()
