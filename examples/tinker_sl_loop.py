"""Supervised fine-tuning through the unmodified ``tinker`` SDK against otray.

    otray tinker &                       # or let this script start one (auth off)
    python examples/tinker_sl_loop.py [--steps 800] [--batch 64] [--rank 128]

A LoRA adapter of the tiny model learns 2-digit addition from (question, answer) chats with
``forward_backward(..., "cross_entropy")`` and ``optim_step``; held-out loss (``forward``) and
greedy held-out accuracy (a sampler from ``save_weights_and_get_sampling_client``) are printed
before and after. Exits 1 when the held-out loss did not go down.
"""

from __future__ import annotations

import argparse
import random
import sys

from tinker import types

from examples.tinker_arith import Clock, accuracy, ensure_service, mean_nll, sft_datum, split_problems, training_client


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-model", default="tiny")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rank", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    ensure_service(base_model=args.base_model)
    clock = Clock()
    service, tc = training_client(args.base_model, args.rank, args.seed)
    tok = tc.get_tokenizer()
    train, held_out = split_problems()
    held = [sft_datum(tok, p) for p in held_out[:200]]
    rng = random.Random(args.seed)
    before = mean_nll(tc, held)
    print(f"{clock} step 0: held-out loss {before:.3f}", flush=True)
    for step in range(1, args.steps + 1):
        batch = [sft_datum(tok, p) for p in rng.sample(train, args.batch)]
        fb = tc.forward_backward(batch, "cross_entropy")  # submitted together: the service applies them in order
        tc.optim_step(types.AdamParams(learning_rate=args.lr * min(1.0, step / 50), grad_clip_norm=1.0)).result()
        if step % args.eval_every == 0 or step == args.steps:
            print(f"{clock} step {step}: train loss/token {fb.result().metrics['loss:sum'] / sum(sum(d.loss_fn_inputs['weights'].tolist()) for d in batch):.3f}"
                  f"  held-out loss {mean_nll(tc, held):.3f}", flush=True)
    after = mean_nll(tc, held)
    sampler = tc.save_weights_and_get_sampling_client(name="sl-final").result()
    acc = accuracy(sampler, tok, held_out)
    print(f"{clock} held-out loss {before:.3f} -> {after:.3f}; greedy held-out accuracy {acc:.1%}", flush=True)
    service.close("success").result()
    return 0 if after < before else 1


if __name__ == "__main__":
    sys.exit(main())
