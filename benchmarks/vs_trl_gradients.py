"""One fixed GRPO batch through otray's learner and through TRL's GRPOTrainer loss: same gradient?

Settles whether a difference between the two in ``vs_trl.py``'s learning comparison can
come from the update itself. The batch: the SFT-warmed tiny checkpoint that ``vs_trl.py``
builds, 8 arithmetic prompts x 4 completions sampled once (temperature 1), rewards from
the env. Then, starting from the same weights:

- otray: ``PolicyLearner.forward_backward`` (ppo, token_mean over the batch's tokens),
  sampler logprobs = the learner's own (ratio 1, as TRL has with ``num_iterations`` 1);
- TRL: ``GRPOTrainer._compute_loss`` (``loss_type`` dapo, ``beta`` 0, ``epsilon`` 0.2) on the
  same token ids, left-padded prompts and right-padded completions as TRL builds them.

Compared against a reference computed without padding (each sequence alone through the
model, the same loss summed), then with each other: with the same advantages fed to both
(the update rule alone), and with each framework's own advantages (otray: population
std + 1e-6; TRL: sample std + 1e-4).
Prints the relative L2 difference and cosine of the full gradients; saves
``benchmarks/results/vs_trl_gradients.json``.

    python benchmarks/vs_trl_gradients.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PROMPTS, GROUP, MAX_NEW = 8, 4, 6


def grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(a: dict, b: dict) -> dict:
    import torch

    names = sorted(set(a) & set(b))
    va = torch.cat([a[n].flatten() for n in names]).double()
    vb = torch.cat([b[n].flatten() for n in names]).double()
    per = {n: float((a[n] - b[n]).norm() / b[n].norm().clamp(min=1e-30)) for n in names}
    worst = sorted(per, key=per.get, reverse=True)[:3]
    return {"params": len(names), "missing": sorted(set(a) ^ set(b)),
            "worst_tensors": {n: per[n] for n in worst},
            "rel_l2_diff": float((va - vb).norm() / vb.norm()),
            "cosine": float(torch.nn.functional.cosine_similarity(va, vb, dim=0)),
            "norm_ratio": float(va.norm() / vb.norm())}


def main() -> None:
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    import vs_trl
    from envs.arithmetic import Arithmetic
    from otray.actors.sampling.backends.hf import HFBackend
    from otray.actors.learner.policy_learner import PolicyLearner
    from otray.algos.advantages import group_zscore
    from otray.models import chat_prompt_ids
    from otray.types import Datum, LossNormalizer, SamplingParams, Task

    torch.set_num_threads(2)
    data, model_dir = vs_trl.data_dir(), str(vs_trl.sft_checkpoint())
    rows = pq.read_table(data / "train.parquet").to_pylist()[:PROMPTS]
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [chat_prompt_ids(tok, [{"role": "user", "content": r["question"]}]) for r in rows]
    samples = HFBackend(model_dir, max_model_len=128).generate(
        prompts, SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=0), GROUP)
    batch, rewards = [], []
    for r, p, group in zip(rows, prompts, samples):
        for s in group:
            env = Arithmetic()
            env.reset(Task(r["id"], "arithmetic", r))
            rewards.append(env.step(tok.decode(s.token_ids, skip_special_tokens=True)).reward)
            batch.append((p, s.token_ids))
    rw = torch.tensor(rewards).view(PROMPTS, GROUP)
    trl_adv = ((rw - rw.mean(1, keepdim=True)) / (rw.std(1, keepdim=True) + 1e-4)).flatten().tolist()
    otray_adv = [a for g in rw.tolist() for a in group_zscore(g)]
    tokens = float(sum(len(c) for _, c in batch))

    def otray_grads(adv: list[float]) -> dict:
        learner = PolicyLearner(model_dir, seed=0)
        datums = []
        for (p, c), a in zip(batch, adv):
            seq = p + c
            n = len(seq) - 1
            mask = [0.0] * (len(p) - 1) + [1.0] * len(c)
            datums.append(Datum(seq[:-1], seq[1:], mask, [a] * n, [0.0] * n))
        own = learner.forward(datums)  # sampler logprobs = the learner's: ratio 1
        datums = [Datum(d.input_ids, d.target_ids, d.mask, d.advantages, lp) for d, lp in zip(datums, own)]
        learner.forward_backward(datums, "ppo", {}, "token_mean", normalizer=LossNormalizer(tokens, len(batch)))
        return grads(learner.model)

    def trl_grads(adv: list[float]) -> dict:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}]} for r in rows])
        cfg = GRPOConfig(output_dir=str(vs_trl.CACHE / "runs" / "grad_check"), use_cpu=True, report_to="none",
                         per_device_train_batch_size=PROMPTS * GROUP, num_generations=GROUP,
                         max_completion_length=MAX_NEW, beta=0.0, epsilon=0.2, loss_type="dapo",
                         scale_rewards="group", num_iterations=1, disable_dropout=True)
        trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                              args=cfg, train_dataset=ds, processing_class=tok)
        trainer.current_gradient_accumulation_steps = 1
        width_p, width_c = max(len(p) for p, _ in batch), max(len(c) for _, c in batch)
        pad = tok.pad_token_id
        prompt_ids = torch.tensor([[pad] * (width_p - len(p)) + p for p, _ in batch])
        prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p, _ in batch])
        completion_ids = torch.tensor([c + [pad] * (width_c - len(c)) for _, c in batch])
        completion_mask = torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for _, c in batch])
        inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                  "completion_mask": completion_mask, "advantages": torch.tensor(adv),
                  "num_items_in_batch": completion_mask.sum()}
        model.train()
        trainer._compute_loss(model, inputs).backward()
        return grads(model)

    def exact_grads(adv: list[float]) -> dict:
        """The reference: each sequence alone (no padding at all), the same loss summed."""
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.train()
        for (p, c), a in zip(batch, adv):
            logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1:-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c).unsqueeze(-1)).squeeze(-1)
            (-(a * lp).sum() / tokens).backward()
        return grads(model)

    mine, theirs, exact = otray_grads(trl_adv), trl_grads(trl_adv), exact_grads(trl_adv)
    out = {"batch": {"prompts": PROMPTS, "group": GROUP, "completion_tokens": tokens, "reward_mean": sum(rewards) / len(rewards)},
           "otray_vs_unpadded": compare(mine, exact), "trl_vs_unpadded": compare(theirs, exact),
           "same_advantages": compare(mine, theirs),
           "own_advantages": compare(otray_grads(otray_adv), theirs)}
    for k in ("otray_vs_unpadded", "trl_vs_unpadded", "same_advantages", "own_advantages"):
        c = out[k]
        print(f"{k:18} relative L2 difference {c['rel_l2_diff']:.2e}, cosine {c['cosine']:.6f}, "
              f"norm ratio {c['norm_ratio']:.4f} ({c['params']} tensors)")
    vs_trl.RESULTS.mkdir(exist_ok=True)
    (vs_trl.RESULTS / "vs_trl_gradients.json").write_text(json.dumps(out, indent=1))
    print(f"saved {vs_trl.RESULTS / 'vs_trl_gradients.json'}")


if __name__ == "__main__":
    main()
