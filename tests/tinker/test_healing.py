"""A learner that dies under its training clients (issue 54): the service rebuilds every live model on
the new learner from its restore point and replay log (otray/tinker/service/healing.py), so the
client goes on with the official SDK and ends with the adapter it would have had. Its own
``otray tinker`` (on the suite's Serve) with a replay log bound of 4 KB, so a restore point is saved every other
step and healing uses both (a saved restore point, then the calls since)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import SERVE_PORT, tinker_fixture
from tests.fixtures.tinker_data import problems, sft, to_otray

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

PORT = SERVE_PORT  # (tests/conftest.py: Serve is started once per pytest process)
URL = f"http://127.0.0.1:{PORT}"
BASE = "Qwen/Qwen3-8B"
LR = 1e-2

svc = tinker_fixture(PORT, "tinker-healing", healing_replay_mb=4 / 1024)


def learner(ray_local):
    from otray.tinker.service.tinker_service import NAME, NAMESPACE

    return ray_local.get_actor(f"{NAME}-learner-{BASE}", namespace=NAMESPACE)


def kill_learner(ray_local) -> None:
    """Kill the base model's learner process; Ray starts it again (without adapters)."""
    ray_local.kill(learner(ray_local), no_restart=False)


def saved_adapter(store: Path, state_path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    model_id, _, name = state_path.removeprefix("tinker://").split("/")
    hits = list(store.glob(f"checkpoints/*/{model_id.replace(':', '_')}/weights/{name}/adapter_model.safetensors"))
    assert len(hits) == 1, hits
    return load_file(str(hits[0]))


def reference(tiny_path: str, steps: list[list], seed: int) -> dict[str, np.ndarray]:
    """An in-process AdapterLearner that never died, trained on the same steps."""
    from otray.tinker.learner.adapter_learner import AdapterLearner
    from otray.tinker.learner.specs import AdamStep, AdapterSpec

    ref = AdapterLearner(tiny_path)
    ref.create("ref", AdapterSpec(4, seed))
    for data in steps:
        ref.forward_backward("ref", [to_otray(d) for d in data], "cross_entropy")
        ref.optim_step("ref", AdamStep(learning_rate=LR))
    return {k.replace(".ref.", ".").replace("base_model.model.", ""): v.numpy()
            for k, v in ref.adapter_tensors("ref").items()}


def max_diff(saved: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> float:
    saved = {k.replace("base_model.model.", ""): v for k, v in saved.items()}
    assert sorted(saved) == sorted(ref), (sorted(saved)[:2], sorted(ref)[:2])
    return max(float(np.abs(saved[k] - ref[k]).max()) for k in saved)


def recoveries(ray_local, key: str, model_id: str) -> list[str]:
    """What ``otray status`` lists as the training client's lease's recoveries, and its state."""
    from otray.actors.control.resource_manager import NAME, NAMESPACE

    rm = ray_local.get_actor(NAME, namespace=NAMESPACE)
    job = next(j for j in ray_local.get(rm.jobs.remote(key)) if j.name == model_id)
    assert job.state == "RUNNING", (job.state, job.error)
    return list(job.recoveries or [])


def test_a_killed_learner_loses_no_step_of_its_clients(svc, ray_local, tokenizer, tiny_path):
    """Two clients train; the learner is killed between steps, and once more while a sample and a
    forward_backward wait on it: both calls are answered, and each adapter ends equal to one trained
    in-process without a death (restore points were saved and used: the log bound is small)."""
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    tcs = [sc.create_lora_training_client(base_model=BASE, rank=4, seed=seed).result() for seed in (3, 4)]
    steps = [[sft(p, a) for p, a in problems(tokenizer, 6, seed=s)] for s in range(6)]
    prompt = types.ModelInput.from_ints(tokenizer.encode("12+34="))

    def step(i: int) -> None:
        for tc in tcs:
            tc.forward_backward(steps[i], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=LR)).result()

    step(0), step(1)
    sampler = tcs[0].save_weights_and_get_sampling_client().result()
    store = svc["store"] / "healing"
    assert len(list(store.glob("*/0*"))) == 2, list(store.glob("*/*"))  # each model's restore point, saved
    kill_learner(ray_local)
    step(2)
    # killed again while the learner holds a long sample and the client's next forward_backward waits for it
    sample = sampler.sample(prompt, 8, types.SamplingParams(max_tokens=120, seed=1, stop=[]))
    fb = tcs[0].forward_backward(steps[3], "cross_entropy")
    time.sleep(0.5)
    kill_learner(ray_local)
    assert len(sample.result().sequences) == 8
    fb.result()
    tcs[0].optim_step(types.AdamParams(learning_rate=LR)).result()
    tcs[1].forward_backward(steps[3], "cross_entropy").result()
    tcs[1].optim_step(types.AdamParams(learning_rate=LR)).result()
    step(4)

    for tc, seed in zip(tcs, (3, 4)):
        got = saved_adapter(svc["store"], tc.save_state("end").result().path)
        assert max_diff(got, reference(tiny_path, steps[:5], seed)) < 1e-5
        info = recoveries(ray_local, svc["alice"], tc.model_id)
        assert len(info) == 2 and all("rebuilt" in r and "no step lost" in r for r in info), info


def test_models_loaded_from_a_checkpoint_since_overwritten_and_deleted_are_rebuilt(svc, ray_local, tokenizer):
    """A client made from a checkpoint, and a live client that loaded it after training on its own (its
    log then holds the load), both come back after a death as they were, although the checkpoint's owner
    wrote it again and then deleted it (the service keeps its own link of the files as loaded, and a save
    writes new files, never the linked ones in place): loaded weights, optimizer state and step."""
    sc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"])
    writer, tc = (sc.create_lora_training_client(base_model=BASE, rank=4, seed=seed).result() for seed in (5, 6))
    data = [sft(p, a) for p, a in problems(tokenizer, 4)]
    probe = [sft(p, a) for p, a in problems(tokenizer, 3, seed=9)]

    def train(client) -> float:
        client.forward_backward(data, "cross_entropy").result()
        return client.optim_step(types.AdamParams(learning_rate=LR)).result().metrics["step:max"]

    def logprobs(client) -> np.ndarray:
        outs = client.forward(probe, "cross_entropy").result().loss_fn_outputs
        return np.concatenate([o["logprobs"].tolist() for o in outs])

    train(writer), train(tc)
    path = writer.save_state("source").result().path
    tc.load_state_with_optimizer(path).result()
    loaded = sc.create_training_client_from_state_with_optimizer(path).result()
    before = logprobs(loaded)
    train(writer)
    writer.save_state("source", overwrite=True).result()  # the owner writes the checkpoint again ...
    tinker.RestClient(base_url=URL, api_key=svc["alice"]).delete_checkpoint_from_tinker_path(path).result()  # ... and deletes it
    kill_learner(ray_local)
    for client in (tc, loaded):
        assert np.allclose(logprobs(client), before, atol=1e-6)
    assert train(tc) == train(loaded) == 2
    assert np.allclose(logprobs(tc), logprobs(loaded), atol=1e-6)
    assert recoveries(ray_local, svc["alice"], tc.model_id) and recoveries(ray_local, svc["alice"], loaded.model_id)


def test_calls_sent_ahead_are_resent_in_order_and_never_ahead_of_a_restore_point(svc, ray_local, tokenizer, tiny_path):
    """The service hands a client's next step to the learner while its last is still there (here: both wait behind
    a long sample). First a big step, whose optim_step takes the replay log past its bound (a restore point is
    saved after it), and a small one (held until that save: ``Healing.due``, whose own test is below; with that
    guard off this test still passed in session 72, the learner having run the save first), then a death. Then two
    small steps, the second sent ahead of the first, and the learner killed under both: they go again, in order,
    once the model is rebuilt. The adapter ends equal to one trained in-process."""
    from otray.tinker.service.tinker_service import NAME, NAMESPACE

    service = ray_local.get_actor(NAME, namespace=NAMESPACE)
    ahead = ray_local.get(service.training_calls.remote())["ahead"]
    tc = tinker.ServiceClient(base_url=URL, api_key=svc["alice"]).create_lora_training_client(
        base_model=BASE, rank=4, seed=7).result()
    small = [[sft(p, a) for p, a in problems(tokenizer, 1, seed=40 + s)] for s in range(5)]
    big = [sft(p, a) for p, a in problems(tokenizer, 8, seed=50)]  # > 4 KB: its step saves a restore point
    prompt = types.ModelInput.from_ints(tokenizer.encode("12+34="))

    def send(data):
        return tc.forward_backward(data, "cross_entropy"), tc.optim_step(types.AdamParams(learning_rate=LR))

    def behind_a_sample(steps: list, kill: bool) -> None:
        sample = sampler.sample(prompt, 8, types.SamplingParams(max_tokens=120, seed=1, stop=[]))
        time.sleep(0.2)
        sent = [send(data) for data in steps]  # the second goes to the learner while the first waits there
        if kill:
            time.sleep(0.5)
            kill_learner(ray_local)
        sample.result()
        [f.result() for pair in sent for f in pair]

    [f.result() for f in send(small[0])]
    sampler = tc.save_weights_and_get_sampling_client().result()
    behind_a_sample([big, small[1]], kill=False)
    kill_learner(ray_local)  # the log since the restore point: small[1] only, whatever went ahead
    deadline = time.monotonic() + 120
    while not recoveries(ray_local, svc["alice"], tc.model_id) and time.monotonic() < deadline:
        time.sleep(0.2)  # rebuilt (the next kill is then a death of its own)
    behind_a_sample(small[2:4], kill=True)
    [f.result() for f in send(small[4])]
    got = saved_adapter(svc["store"], tc.save_state("end").result().path)
    assert max_diff(got, reference(tiny_path, [small[0], big, *small[1:]], 7)) < 1e-5
    assert len(recoveries(ray_local, svc["alice"], tc.model_id)) == 2
    assert ray_local.get(service.training_calls.remote())["ahead"] > ahead  # small[3] went ahead of small[2]


def test_a_call_does_not_go_ahead_of_a_step_that_saves_a_restore_point(tmp_path):
    """``Healing.due`` (what keeps a training call from going to the learner ahead of calls whose recording saves
    a restore point) says so exactly when ``ran`` will."""
    from otray.tinker.learner.specs import AdamStep, AdapterSpec
    from otray.tinker.service.healing import Healing, Pass, Step
    from otray.types import Datum

    async def nothing(*_) -> None:
        return None

    healing = Healing({"base": None}, tmp_path, 4000, nothing, nothing, lambda base: [])
    healing.made("m", "alice", "base", AdapterSpec(4, 0))
    datum = Datum(list(range(60)), list(range(60)), [1.0] * 60, [0.0] * 60, [0.0] * 60)
    fb = (Pass([datum], "cross_entropy", None, None), Healing.size(Pass([datum], "cross_entropy", None, None)))
    step = (Step(AdamStep()), Healing.size(Step(AdamStep())))
    saves = []
    for _ in range(12):
        due = healing.due("m", [fb, step])
        assert not healing.due("m", [fb]) and not healing.due("unknown", [fb, step])
        saves.append(healing.ran("m", *fb) or healing.ran("m", *step))
        assert saves[-1] == due
        if due:
            healing.replays["m"].bytes = 0  # as a snapshot starts the log over
    assert any(saves) and not all(saves), saves


def test_a_replay_log_is_bounded_even_without_optim_steps(tmp_path):
    """Past the bound, the next optim_step asks for a restore point; a client that only sends
    forward_backward calls (a gradient pending, so no restore point can be saved) has its log dropped at
    twice the bound, with the reason a later death will give: the service's memory stays bounded."""
    from otray.tinker.learner.specs import AdamStep, AdapterSpec
    from otray.tinker.service.healing import Healing, Pass, Step
    from otray.types import Datum

    async def nothing(*_) -> None:
        return None

    healing = Healing({"base": None}, tmp_path, 4000, nothing, nothing, lambda base: [])
    datum = Datum(list(range(100)), list(range(100)), [1.0] * 100, [0.0] * 100, [0.0] * 100)
    call = Pass([datum], "cross_entropy", None, None)
    for model_id in ("stepping", "accumulating"):
        healing.made(model_id, "alice", "base", AdapterSpec(4, 0))
    assert not healing.ran("stepping", call) and not healing.ran("stepping", Step(AdamStep()))
    while healing.replays["stepping"].bytes <= 4000:
        assert not healing.ran("stepping", call)
    assert healing.ran("stepping", Step(AdamStep()))  # past the bound, at a step: save a restore point now
    for _ in range(100):
        healing.ran("accumulating", call)
    assert "accumulating" not in healing.replays and "twice healing_replay_mb" in healing.lost["accumulating"]
    healing.forget("accumulating")
    assert "accumulating" not in healing.lost
