"""The tiny vision-language model and images through sampler, learner, agent loop and weights (in-process)."""

from __future__ import annotations

import hashlib
from pathlib import Path
import random

import pytest
import torch

from envs.shapes import CountShapes, count_task
from otray.actors.learner.core import token_logprobs
from otray.actors.sampling.backends.hf import HFBackend
from otray.algos.datums import build_datums
from otray.actors.rollout.agent_loop import AgentLoop, Limits
from otray.env import Env, StepResult
from otray.models import LoraSpec, apply_lora, build_tiny_model, copy_side_files, load_model
from otray.types import GenerateResult, SamplingParams, Task, Trajectory
from otray.vision import Image, ImageError
from otray.vlm import TINY_VL_ROPE_THETA, VisionInputs, observation_prompt, unsampled_ids, vision_inputs
from envs.shapes import draw, scene

TOL = 1e-4  # the text path's sampler/learner tolerance (tests/actors/sampling)


@pytest.fixture(scope="module")
def backend(vl_path) -> HFBackend:
    return HFBackend(vl_path, seed=0)


def pictures(n: int) -> list[Image]:
    return [draw(scene(s)[1]) for s in range(n)]


def prompts(backend: HFBackend, images: list[Image]) -> list[list[int]]:
    return [observation_prompt(backend.tokenizer, [], [im, "How many shapes?"])[0] for im in images]


def trajectories(backend, images, n=2, params=SamplingParams(max_tokens=8, seed=1)) -> list[Trajectory]:
    ids = prompts(backend, images)
    out = backend.generate(ids, params, n, images=[(im,) for im in images])
    trajs = []
    for p, im, samples in zip(ids, images, out):
        for s in samples:
            t = Trajectory(task=Task("t", "count_shapes"), images=[im])
            t.append(p, sampled=False)
            t.prompt_len = len(p)
            t.append(s.token_ids, sampled=True, logprobs=s.logprobs)
            trajs.append(t)
    return trajs


def max_gap(model, trajs) -> float:
    datums = build_datums(trajs, [1.0] * len(trajs))
    with torch.no_grad():
        lp, _ = token_logprobs(model, datums)
    return max(abs(q - float(lp[i, j])) for i, d in enumerate(datums)
               for j, (m, q) in enumerate(zip(d.mask, d.sampler_logprobs)) if m)


def test_tiny_vlm_is_byte_identical_per_seed_and_a_real_qwen2_vl(tmp_path, vl_path):
    digest = lambda d: {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}
    a = build_tiny_model(tmp_path / "a", seed=0, shape="vl")
    assert digest(a) == digest(build_tiny_model(tmp_path / "b", seed=0, shape="vl"))
    assert digest(a) != digest(build_tiny_model(tmp_path / "c", seed=1, shape="vl"))
    model = load_model(str(a))
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    vision = VisionInputs.load(str(a))
    assert vision.tokens_per_image(pictures(1)[0]) == 4  # 56x56: 4x4 patches of 14, merged 2x2
    assert len(unsampled_ids(model.config)) == 3  # vision start, image pad (= video pad), vision end
    # the rotary base that lets it tell columns apart, and a cache name that a build of another base never had
    assert model.config.text_config.rope_parameters["rope_theta"] == TINY_VL_ROPE_THETA < 100
    assert Path(vl_path).name == "tiny-vl-seed0-r1"


def test_sampler_and_learner_agree_on_image_prompts_and_the_image_matters(backend):
    images = pictures(3)
    trajs = trajectories(backend, images)
    assert all(backend.model.config.image_token_id not in t.token_ids[t.prompt_len:] for t in trajs)
    assert max_gap(backend.model, trajs) < TOL
    # the same sampled tokens after another picture score differently: the model sees the image
    swapped = [Trajectory(task=t.task, images=[images[(k // 2 + 1) % 3]], token_ids=t.token_ids,
                          loss_mask=t.loss_mask, logprobs=t.logprobs) for k, t in enumerate(trajs)]
    assert max_gap(backend.model, swapped) > 1e-3


def test_mismatched_and_unwanted_images_are_clear_errors(backend, tiny_path):
    im = pictures(1)[0]
    ids = prompts(backend, [im])[0]
    with pytest.raises(ImageError, match="holds 4 image tokens but its 2 image"):
        backend.generate([ids], SamplingParams(max_tokens=2), 1, images=[(im, im)])
    vision = vision_inputs(backend.model)
    with pytest.raises(ImageError, match="2 image tokens but 1 images"):
        vision.expand([vision.image_token_id] * 2, [im])
    with pytest.raises(ImageError, match="this model takes at most 8"):
        vision.check_count([im] * 9)
    text_only = HFBackend(tiny_path)
    with pytest.raises(ImageError, match="text-only model"):
        observation_prompt(text_only.tokenizer, [], [im, "How many?"])


def test_full_and_lora_updates_reach_the_sampler_vision_tower_included(vl_path, backend):
    images = pictures(2)
    learner = load_model(vl_path)
    with torch.no_grad():  # a "training step" on the vision tower and the language model
        learner.model.visual.blocks[0].mlp.fc1.weight.add_(0.05)
        learner.model.language_model.layers[0].mlp.up_proj.weight.add_(0.05)
    sampler = HFBackend(vl_path)
    assert max_gap(learner, trajectories(sampler, images)) > 1e-3  # not yet updated
    sampler.load_full_weights(learner.state_dict())
    assert max_gap(learner, trajectories(sampler, images)) < TOL

    lora = apply_lora(load_model(vl_path), LoraSpec(rank=4))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.add_(0.02)
    from peft import get_peft_model_state_dict

    fresh = HFBackend(vl_path)
    fresh.load_lora(get_peft_model_state_dict(lora), lora.peft_config["default"].to_dict(), version=1)
    assert max_gap(lora, trajectories(fresh, images)) < TOL
    assert max_gap(load_model(vl_path), trajectories(fresh, images)) > 1e-3  # the adapter changed the policy


def test_checkpoint_round_trip_keeps_the_policy(vl_path, backend, tmp_path):
    trajs = trajectories(backend, pictures(2))
    model = load_model(vl_path)
    model.save_pretrained(tmp_path / "ckpt")
    copy_side_files(vl_path, tmp_path / "ckpt")  # what the learner's save_pretrained and serve's merge do
    assert (tmp_path / "ckpt" / "preprocessor_config.json").exists()
    assert max_gap(load_model(str(tmp_path / "ckpt")), trajs) < TOL


class _TwoPictures(Env):
    """Shows a picture, then another after the first reply."""

    max_turns = 2

    def reset(self, task, seed=None):
        self.turn = 0
        return [pictures(1)[0], "Look."], {}

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return StepResult(["And this:", pictures(2)[1]], 0.0, False)
        return StepResult("", 1.0, True)


def test_agent_loop_carries_images_over_turns(backend, tokenizer):
    def generate(prompts, params, n, **images):
        return [GenerateResult(s, 0) for s in backend.generate(prompts, params, n, **images)]

    loop = AgentLoop(backend.tokenizer, generate, Limits(max_turns=2, max_tokens_per_turn=4, max_model_len=64))
    task = Task("t", "count_shapes", count_task(random.Random(0)))
    shapes, two = loop.run([(task, CountShapes(), 0), (Task("u", "two"), _TwoPictures(), 0)], SamplingParams(max_tokens=4))
    pad = backend.model.config.image_token_id
    assert shapes.error is None and len(shapes.images) == 1 and shapes.token_ids.count(pad) == 4
    assert shapes.messages[0]["content"] == "<image>How many shapes are in the picture?"
    assert two.error is None and two.num_turns == 2 and two.images == pictures(2)
    assert two.token_ids.count(pad) == 8 and two.messages[2]["content"] == "And this:<image>"
    assert max_gap(backend.model, [shapes, two]) < TOL
    # an image for a text-only model fails that episode with a clear record, not the batch
    text_loop = AgentLoop(tokenizer, generate, Limits(max_model_len=64))
    failed, = text_loop.run([(task, CountShapes(), 0)], SamplingParams(max_tokens=4))
    assert failed.error.kind == "bad_observation" and "text-only model" in failed.error.message


def test_chat_datum_with_an_image_and_the_times_demonstrations(backend, tmp_path, tokenizer):
    import json

    from envs.shapes import make_times_chat
    from otray.algos.datums import chat_datum
    from otray.types import DatasetError

    paths = make_times_chat(str(tmp_path), num_train=4, num_eval=1)
    row = json.loads(paths["train"].read_text().splitlines()[0])
    assert row["messages"][1]["content"][0]["type"] == "image_url"
    datum = chat_datum(backend.tokenizer, row["messages"])
    pad = backend.model.config.image_token_id
    assert len(datum.images) == 1 and datum.input_ids.count(pad) == 4
    # only the two assistant turns train: the tool call and the answer, each with its end-of-turn token
    trained = backend.tokenizer.decode([t for t, m in zip(datum.target_ids, datum.mask) if m])
    assert trained == row["messages"][2]["content"] + "<|im_end|>" + row["messages"][4]["content"] + "<|im_end|>"
    with torch.no_grad():
        lp, _ = token_logprobs(backend.model, [datum])  # the learner takes it: pixels and tokens match
    assert torch.isfinite(lp).all()
    with pytest.raises(DatasetError, match="text-only model"):
        chat_datum(tokenizer, row["messages"])
    bad = [dict(m) for m in row["messages"]]
    bad[1] = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
    with pytest.raises(DatasetError, match="message 1: unreadable image"):
        chat_datum(backend.tokenizer, bad)


def test_geometry3k_rows_from_parquet(tmp_path):
    from envs.geometry3k import Geometry3K, make_figures
    from otray.env import TaskSource, check_env
    from otray.types import DatasetError

    source = TaskSource.from_file(make_figures(tmp_path / "g3k.parquet", n=3), "geometry3k")
    env = Geometry3K()
    for task in source.tasks:
        check_env(env, task)
        first, _ = env.reset(task)
        assert isinstance(first[0], Image) and first[1].startswith("Find the hypotenuse")
        assert env.step(f"\\boxed{{{float(task.data['answer']):.2f}}}").reward == 1.0
    env.reset(source.tasks[0])
    assert env.step("\\boxed{1}").reward == 0.0
    broken = Task("b", "geometry3k", {"images": [{"bytes": b"junk"}], "problem": "<image>x?", "answer": "1"})
    with pytest.raises(DatasetError, match="image 0: unreadable image"):
        env.reset(broken)


def test_geometry_figures_are_drawn_per_task_and_scored_like_geometry3k():
    """The data-free sibling: each task's figure drawn with its two lengths (the same task, the same picture;
    other lengths, another picture), every kind's question, the right number earns 1."""
    import random

    from envs.geometry3k import QUESTIONS, GeometryFigures, figure, figure_task
    from otray.env import check_env, make
    from otray.types import DatasetError

    rng = random.Random(0)
    tasks = [Task(f"t{i}", "geometry_figures", figure_task(rng)) for i in range(24)]
    assert {t.data["kind"] for t in tasks} == set(QUESTIONS)
    env = make("geometry_figures")
    assert isinstance(env, GeometryFigures)
    for task in tasks[:4]:
        check_env(env, task)
    for task in tasks:
        first, _ = env.reset(task)
        assert first[0].data == env.reset(task)[0][0].data and first[1] == QUESTIONS[task.data["kind"]][0]
        assert env.step(f"The answer is \\boxed{{{task.data['answer']}}}.").reward == 1.0
    right = tasks[0].data
    env.reset(tasks[0])
    assert env.step(f"\\boxed{{{float(right['answer']) + 1}}}").reward == 0.0
    assert figure("rectangle_area", 3, 4).data != figure("rectangle_area", 3, 5).data  # the labels are drawn
    assert figure_task(random.Random(1), ("hypotenuse",))["answer"] in {"5", "10", "13", "17", "15", "25", "20", "29"}
    with pytest.raises(DatasetError, match="no figure kind 'circle'"):
        env.reset(Task("c", "geometry_figures", {"kind": "circle", "a": 1, "b": 2}))
    with pytest.raises(DatasetError, match=r"lacks \['b'\]"):
        env.reset(Task("c", "geometry_figures", {"kind": "hypotenuse", "a": 1}))
