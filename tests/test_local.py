"""Tinker-style primitives on actor handles, and the custom-loop example."""

import os
import shutil
import subprocess
import tempfile

import pytest
import sys
from pathlib import Path

from otray.algos.datums import sft_datum
from otray.local import TrainingClient
from otray.models import chat_prompt_ids
from otray.types import SamplingParams

from tests.conftest import ROOT  # noqa: E402 (the repository root)


def test_train_save_load_and_sample(ray_local, tiny_path, tokenizer, tmp_path):
    tc = TrainingClient(tiny_path, lora_rank=0)
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": "5+5="}])
    target = tokenizer.encode("10", add_special_tokens=False) + [tokenizer.eos_token_id]
    first = tc.forward_backward([sft_datum(prompt, target)], "cross_entropy")["loss"]
    tc.optim_step(learning_rate=1e-2)
    for _ in range(40):
        tc.forward_backward([sft_datum(prompt, target)], "cross_entropy")
        tc.optim_step(learning_rate=1e-2)
    assert tc.forward_backward([sft_datum(prompt, target)], "cross_entropy")["loss"] < first / 2
    tc.optim_step(learning_rate=0.0)  # clear the accumulated gradient; weights unchanged
    sampler = tc.sampling_client()
    out = sampler.sample([prompt], SamplingParams(max_tokens=4, temperature=0.0), 1)[0]
    assert out.samples[0].token_ids == target and out.policy_version == 42
    tc.save_state(str(tmp_path / "ck"))
    other = TrainingClient(tiny_path, lora_rank=0)
    assert other.load_state(str(tmp_path / "ck")).step == 42
    logits_a = tc.forward([sft_datum(prompt, target)])[0]
    assert other.forward([sft_datum(prompt, target)])[0] == logits_a


@pytest.mark.ray  # the example starts a Ray of its own
def test_custom_loop_example_runs(tmp_path):
    # a `ray start` killed without `ray stop` leaves its address in <RAY_TMPDIR>/ray_current_cluster, and a
    # plain ray.init() joins it (hanging for minutes): the example starts a cluster of its own all the same
    ray_tmp = Path(tempfile.mkdtemp(prefix="orl", dir="/tmp"))  # short: Ray's socket paths live under it
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:6399")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_TMPDIR": str(ray_tmp)}
    env.pop("RAY_ADDRESS", None)
    try:
        run = subprocess.run([sys.executable, str(ROOT / "examples" / "custom_loop.py"), "--steps", "2",
                              "--sft-steps", "5", "--group", "2"], capture_output=True, text=True, cwd=tmp_path,
                             timeout=300, env=env)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "after SFT: held-out accuracy" in run.stdout and "after 2 GRPO steps" in run.stdout
