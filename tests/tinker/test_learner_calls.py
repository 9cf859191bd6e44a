"""The service's :class:`~otray.tinker.service.learner_calls.LearnerCalls` against real SharedLearner actors (tiny
model, local Ray): small training calls of several clients travel as one learner call and each is answered as
its own call would be; a member whose request fails, or whose model left while it waited, fails alone; a big call
goes at once, alone."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from otray.tinker.errors import AdapterGone, UserError
from otray.tinker.learner.calls import PairCall, PassCall, StepCall
from otray.tinker.learner.passes import PassRequest, TrainStepResult
from otray.tinker.learner.specs import AdamStep, AdapterSpec
from otray.tinker.service.learner_calls import LearnerCalls
from otray.types import Datum

USERS = 6
ADAM = AdamStep(learning_rate=0.02)


def datum(seed: int, n: int = 9) -> Datum:
    ids = np.random.default_rng(seed).integers(1, 200, n + 1).tolist()
    return Datum(ids[:-1], ids[1:], [1.0] * n, [0.0] * n, [0.0] * n, [1.0] * n)


@pytest.fixture(scope="module")
def learners(ray_local, tiny_path):
    """Two learners with the same adapters: one fed through LearnerCalls, one fed each call alone."""
    from otray.tinker.learner.shared_learner import SharedLearner

    made = [ray_local.remote(SharedLearner).options(num_cpus=0).remote(tiny_path, num_threads=1, pass_tokens=2560)
            for _ in range(2)]
    ray_local.get([lr.create.remote(f"user{i}", f"m{i}", AdapterSpec(4, seed=i)) for lr in made for i in range(USERS)])
    yield made
    for lr in made:
        ray_local.kill(lr)


def pair(i: int, step: int) -> PairCall:
    return PairCall(PassCall(f"user{i}", PassRequest(f"m{i}", [datum(10 * i + step)], "cross_entropy")), ADAM)


def test_small_calls_of_several_clients_go_as_one_and_answer_as_alone(ray_local, learners, tmp_path):
    together, alone = learners
    calls = LearnerCalls(small_tokens=512)

    async def round_of(step: int) -> list:  # two go at once, one by one (the depth: 2), the other four wait for them
        sends = []
        for i in range(USERS):
            sends.append(asyncio.ensure_future(calls.send(pair(i, step), lambda: together)))
            if i < 2:
                await asyncio.sleep(0.001)  # it goes before the next is sent
        return await asyncio.gather(*sends)

    for step in range(2):
        got = asyncio.run(round_of(step))
        want = ray_local.get([alone.calls.remote([pair(i, step)]) for i in range(USERS)])
        for g, (w,) in zip(got, want):
            assert isinstance(g, TrainStepResult) and g.optim_step == w.optim_step
            assert np.allclose(np.concatenate(g.forward_backward.logprobs), np.concatenate(w.forward_backward.logprobs),
                               atol=1e-5)
    # per round: one call each for the first two, then the four that waited as one (none waited for the first two:
    # their last gaps were longer than follow_s)
    assert calls.sent == {"calls": 6, "requests": 12}
    assert ray_local.get(together.usage.remote())["batched"] == {"calls": 6, "members": 12}
    from safetensors.numpy import load_file

    for i in range(USERS):  # each adapter after two steps: as the one stepped by calls of its own
        ray_local.get([lr.save.remote(f"user{i}", f"m{i}", str(tmp_path / f"{k}-{i}"), False)
                       for k, lr in enumerate(learners)])
        a, b = (load_file(str(tmp_path / f"{k}-{i}" / "adapter_model.safetensors")) for k in range(2))
        assert a.keys() == b.keys() and all(np.allclose(a[k], b[k], atol=1e-5) for k in a)
        assert any(np.abs(a[k]).max() > 0 for k in a if "lora_B" in k)  # they trained


def test_a_failing_member_a_model_gone_and_a_big_call_each_alone(ray_local, learners):
    together, _ = learners
    calls = LearnerCalls(small_tokens=64)
    gone = set()

    def learner_of(model: str):
        def look():
            if model in gone:
                raise UserError(f"model {model!r} is not loaded", 404)
            return together
        return look

    bad = Datum([1, 2, 3], [2, 3, 10 ** 7], [1.0] * 3, [0.0] * 3, [0.0] * 3, [1.0] * 3)  # a target past the vocabulary
    big = [datum(99, 40), datum(98, 40)]  # 80 tokens: past small_tokens

    async def scenario() -> list:
        sends = [calls.send(StepCall("user0", "m0", ADAM), learner_of("m0")),  # these two go at once
                 calls.send(StepCall("user1", "m1", ADAM), learner_of("m1")),
                 calls.send(PassCall("user2", PassRequest("m2", [bad], "cross_entropy")), learner_of("m2")),  # wait
                 calls.send(PassCall("user3", PassRequest("m3", [datum(3)], "cross_entropy")), learner_of("m3")),
                 calls.send(PassCall("user4", PassRequest("m4", [datum(4)], "cross_entropy")), learner_of("m4")),
                 calls.send(PassCall("user5", PassRequest("m5", big, "cross_entropy")), learner_of("m5")),  # at once
                 calls.send(PassCall("user1", PassRequest("nobody", [datum(5)], "cross_entropy")), lambda: together)]
        tasks = [asyncio.ensure_future(s) for s in sends]
        await asyncio.sleep(0)
        gone.add("m4")  # its model left while it waited: refused, its rows never sent
        return await asyncio.gather(*tasks, return_exceptions=True)

    got = asyncio.run(scenario())
    assert all(isinstance(g, dict) for g in got[:2])
    assert isinstance(got[2], IndexError) and "out of bounds" in str(got[2])  # its own error, alone
    assert len(got[3].logprobs[0]) == 9
    assert isinstance(got[4], UserError) and "not loaded" in str(got[4])
    assert len(got[5].logprobs) == 2
    assert isinstance(got[6], AdapterGone)  # an adapter the learner does not hold fails alone too
    # two at once, the big one alone, then the three that waited (m4 refused) as one
    assert calls.sent == {"calls": 4, "requests": 6}


def test_clients_that_loop_alike_share_one_call(ray_local, learners):
    """Four clients loop ten steps, each sending its next 5 i ms after its answer (client i): once their gaps are
    known, the next call waits for all four (Followers.gather), so a round is one learner call where the first back
    would go alone (nothing on the learner), the next too (one on it), the rest in a third (follow_s=0: 8 calls in
    the rounds counted, as here 4; under make test's load one round of 1.5 came out: a bound of 6)."""
    together, _ = learners
    calls = LearnerCalls(small_tokens=512)
    marks: list[int] = []  # the learner calls sent before client 0's each step

    async def client(i: int) -> None:
        for step in range(10):
            if i == 0:
                marks.append(calls.sent["calls"])
            await calls.send(pair(i, step), lambda: together)
            await asyncio.sleep(0.005 * i)

    async def scenario() -> None:
        await asyncio.gather(*[client(i) for i in range(4)])

    asyncio.run(scenario())
    assert calls.sent["requests"] == 40
    # rounds 4-7, their gaps long known: one call each (two more for the machine's noise)
    assert marks[8] - marks[4] <= 6, (marks, calls.sent)


class Watched(LearnerCalls):
    """LearnerCalls noting the clients of each coalesced learner call it sends."""

    def __init__(self, small_tokens: int):
        super().__init__(small_tokens)
        self.held: list[list[tuple[str, str]]] = []

    async def _call(self, handle, members) -> None:
        self.held.append([m.call.client() for m in members])
        await super()._call(handle, members)


def test_a_clients_calls_handed_over_before_their_answers_keep_their_order(ray_local, learners):
    """Three clients each hand over two steps at once, and a fourth a small step then a big forward_backward while
    the learner is full (the service sends a model's next call while its last is on the learner): a learner call
    holds at most one call of a client, the big one waits behind its client's small one, and every answer equals
    the same calls sent one by one."""
    together, alone = learners
    ray_local.get([lr.create.remote(f"user{i}", f"n{i}", AdapterSpec(4, seed=20 + i)) for lr in learners
                   for i in range(4)])

    def step_of(i: int, step: int) -> PairCall:
        return PairCall(PassCall(f"user{i}", PassRequest(f"n{i}", [datum(100 + 10 * i + step)], "cross_entropy")), ADAM)

    big = PassCall("user3", PassRequest("n3", [datum(97, 40), datum(96, 40)], "cross_entropy"))  # 80 tokens
    order = [step_of(i, s) for s in range(2) for i in range(3)] + [step_of(3, 0), big]
    calls = Watched(small_tokens=64)

    async def scenario() -> list:
        return await asyncio.gather(*[calls.submit(c, lambda: together) for c in order])

    got = asyncio.run(scenario())
    want = [ray_local.get(alone.calls.remote([c]))[0] for c in order]
    for g, w in zip(got[:7], want[:7]):
        assert g.optim_step == w.optim_step
        assert np.allclose(g.forward_backward.logprobs[0], w.forward_backward.logprobs[0], atol=1e-5)
    assert all(np.allclose(a, b, atol=1e-5) for a, b in zip(got[7].logprobs, want[7].logprobs))
    assert all(len(set(h)) == len(h) for h in calls.held), calls.held  # one call of a client in a learner call
    flat = [c for h in calls.held for c in h]
    assert sorted(flat) == sorted(c.client() for c in order)  # the big one too went as a (coalesced) call: queued
    assert flat.index(("user3", "n3")) < len(flat) - 1 and calls.held[-1] == [("user3", "n3")]
