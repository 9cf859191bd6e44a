"""How the Tinker service's sample batcher cuts a batch for the vLLM engine (``fair_cut``): pure, no Ray."""

from __future__ import annotations

from otray.tinker.learner.prompt_scores import Scoring
from otray.tinker.service.sampling import SampleWait, fair_cut
from otray.types import SamplingParams


def wait(rid: str, n: int = 1, images: tuple = ()) -> SampleWait:
    return SampleWait(rid, None, [1, 2, 3], SamplingParams(max_tokens=4), n, Scoring(), None, images=images)


def ids(queue) -> list[str]:
    return [w.request_id for _, w in queue]


def test_a_flood_is_cut_into_calls_and_another_user_goes_in_the_first_turn():
    queue = [("alice", wait(f"a{i}", n=4)) for i in range(10)] + [("bob", wait("b0"))]
    now, left = fair_cut(queue, 8, lambda w: True)
    assert ids(now) == ["a0", "b0", "a1"]  # turns: alice, bob, alice (8 samples reached: 4 + 1 + 4 > 8)
    assert ids(left) == [f"a{i}" for i in range(2, 10)]  # the rest, in arrival order, for the next calls
    calls, rest = [], left
    while rest:
        now, rest = fair_cut(rest, 8, lambda w: True)
        calls.append(ids(now))
    assert calls == [["a2", "a3"], ["a4", "a5"], ["a6", "a7"], ["a8", "a9"]]


def test_uncapped_requests_all_go_and_one_capped_request_always_goes():
    learner_only = wait("img", images=("picture",))  # images: the learner's, not cut
    queue = [("alice", wait("big", n=100)), ("bob", learner_only), ("carol", wait("c0"))]
    now, left = fair_cut(queue, 8, lambda w: not w.learner_only())
    assert ids(now) == ["img", "big"] and ids(left) == ["c0"]  # one request over the budget still goes alone
    assert fair_cut([], 8, lambda w: True) == ([], [])
    everything = [("alice", wait(f"a{i}")) for i in range(3)]
    assert fair_cut(everything, 8, lambda w: True) == (everything, [])  # under the budget: one call, in order
