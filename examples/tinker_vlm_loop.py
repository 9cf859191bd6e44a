"""A vision-language RL loop through the unmodified ``tinker`` SDK against otray: count the shapes in a picture.

    python examples/tinker_vlm_loop.py [--rl-steps 20] [--out benchmarks/results/tinker_vlm_loop.json]

The base model is otray's tiny Qwen2-VL (``tiny-vl``; this script starts ``otray tinker`` with it when
nothing answers at ``TINKER_BASE_URL``). Prompts are the chat template's text with the picture as an
``ImageChunk`` between ``<|vision_start|>`` and ``<|vision_end|>``, its token count computed with the
model's own image processor, as a cookbook renderer does. 1. SFT warm-up (``cross_entropy`` on the count)
until greedy accuracy on 64 training pictures reaches ``--warmup-accuracy``; 2. RL: per step, sampler
weights saved, ``--group`` answers sampled per picture, reward 1 for the right count, group-centred
advantages, ``importance_sampling`` + ``optim_step``. Held-out greedy accuracy (pictures never trained on)
before and after RL is printed and saved.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from tinker import types

from envs.shapes import count_task, draw, scene
from examples.tinker_arith import Clock, ensure_service, training_client

BASE = "tiny-vl"
QUESTION = "How many shapes are in the picture?"


class Renderer:
    """Prompt and answer tokens for the tiny VLM: text chunks around one image chunk."""

    def __init__(self, tok, model_dir: str):
        from transformers import AutoImageProcessor

        self.tok = tok
        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
                                       add_generation_prompt=True, tokenize=False)
        head, tail = text.split("<|image_pad|>")
        self.head = tok.encode(head, add_special_tokens=False)
        self.tail = tok.encode(tail, add_special_tokens=False)
        self.end = tok.convert_tokens_to_ids("<|im_end|>")

    def prompt(self, seed: int) -> types.ModelInput:
        picture = draw(scene(seed)[1])
        grid = self.processor(images=[picture.to_pil()], return_tensors="pt")["image_grid_thw"][0]
        tokens = int(grid.prod()) // self.processor.merge_size ** 2
        return types.ModelInput(chunks=[types.EncodedTextChunk(tokens=self.head),
                                        types.ImageChunk(data=picture.data, format="png", expected_tokens=tokens),
                                        types.EncodedTextChunk(tokens=self.tail)])

    def answer(self, seed: int) -> list[int]:
        return self.tok.encode(str(scene(seed)[0]), add_special_tokens=False) + [self.end]

    def sft_datum(self, seed: int) -> types.Datum:
        prompt, answer = self.prompt(seed), self.answer(seed)
        n = prompt.length
        return types.Datum(model_input=prompt.append(types.EncodedTextChunk(tokens=answer[:-1])), loss_fn_inputs={
            "target_tokens": [0] * (n - 1) + answer, "weights": [0.0] * (n - 1) + [1.0] * len(answer)})

    def rl_datum(self, seed: int, seq, advantage: float) -> types.Datum:
        prompt = self.prompt(seed)
        n = prompt.length
        return types.Datum(model_input=prompt.append(types.EncodedTextChunk(tokens=list(seq.tokens[:-1]))),
                           loss_fn_inputs={"target_tokens": [0] * (n - 1) + list(seq.tokens),
                                           "logprobs": [0.0] * (n - 1) + list(seq.logprobs),
                                           "advantages": [0.0] * (n - 1) + [advantage] * len(seq.tokens)})

    def correct(self, seed: int, tokens: list[int]) -> bool:
        found = re.findall(r"\d+", self.tok.decode(tokens, skip_special_tokens=True))
        return bool(found) and int(found[-1]) == scene(seed)[0]


def accuracy(sampler, r: Renderer, seeds: list[int]) -> float:
    params = types.SamplingParams(max_tokens=3, temperature=0.0)
    futures = [sampler.sample(r.prompt(s), 1, params) for s in seeds]
    return sum(r.correct(s, f.result().sequences[0].tokens) for s, f in zip(seeds, futures)) / len(seeds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument("--warmup-accuracy", type=float, default=0.4)
    parser.add_argument("--rl-steps", type=int, default=20)
    parser.add_argument("--rl-lr", type=float, default=1e-4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    ensure_service(base_model=BASE, path="tiny-vl")
    from otray.models import resolve_model_path

    clock = Clock()
    service, tc = training_client(BASE, rank=16, seed=args.seed)
    r = Renderer(tc.get_tokenizer(), resolve_model_path("tiny-vl"))
    rng = random.Random(args.seed)
    train = [count_task(rng)["seed"] for _ in range(2000)]
    held_out = [count_task(random.Random(10_000 + i))["seed"] for i in range(100)]
    probe = train[:64]
    for step in range(1, args.warmup_steps + 1):
        tc.forward_backward([r.sft_datum(s) for s in rng.sample(train, 32)], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-3 * min(1.0, step / 20), grad_clip_norm=1.0))
        if step % 25 == 0:
            acc = accuracy(tc.save_weights_and_get_sampling_client().result(), r, probe)
            print(f"{clock} sft {step}: training-picture accuracy {acc:.1%}", flush=True)
            if acc >= args.warmup_accuracy:
                break
    before = accuracy(tc.save_weights_and_get_sampling_client().result(), r, held_out)
    print(f"{clock} held-out accuracy after SFT: {before:.1%}", flush=True)
    for step in range(1, args.rl_steps + 1):
        sampler = tc.save_weights_and_get_sampling_client().result()
        seeds = rng.sample(train, args.batch)
        futures = [sampler.sample(r.prompt(s), args.group, types.SamplingParams(max_tokens=3, temperature=1.0))
                   for s in seeds]
        data, rewards = [], []
        for s, f in zip(seeds, futures):
            seqs = f.result().sequences
            group = [float(r.correct(s, q.tokens)) for q in seqs]
            rewards += group
            mean = sum(group) / len(group)
            if any(g != mean for g in group):  # a group whose rewards are all equal carries no gradient
                data += [r.rl_datum(s, q, g - mean) for q, g in zip(seqs, group)]
        if data:
            tc.forward_backward(data, "importance_sampling")
            tc.optim_step(types.AdamParams(learning_rate=args.rl_lr, grad_clip_norm=1.0))
        print(f"{clock} rl {step}: reward {sum(rewards) / len(rewards):.3f} ({len(data)} datums)", flush=True)
    after = accuracy(tc.save_weights_and_get_sampling_client().result(), r, held_out)
    print(f"{clock} held-out accuracy: {before:.1%} after SFT -> {after:.1%} after {args.rl_steps} RL steps")
    if args.out:
        args.out.write_text(json.dumps({"after_sft": before, "after_rl": after, "rl_steps": args.rl_steps,
                                        "seconds": round(float(str(clock).rstrip("s")), 1)}, indent=1))


if __name__ == "__main__":
    main()
