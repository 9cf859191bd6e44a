"""A generate call run in turns (otray/actors/sampling/backends/hf_turns.py) gives what the call uncut gives."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from otray.actors.sampling.backends.hf import HFBackend
from otray.types import FinishReason, SamplingParams


@pytest.fixture(scope="module")
def backend(tiny_path):
    return HFBackend(tiny_path, max_model_len=64, max_batch=5, packed_linears=False)


def prompts(backend):
    texts = ["12 plus 30 is", "the answer is the sum of", "you are a helpful assistant", "7"]
    return [backend.tokenizer.encode(t) for t in texts]


def in_turns(backend, params, n, turn_s, stop=None):
    call = backend.turns(prompts(backend), params, n, stop=stop, turn_s=turn_s)
    turns = 1
    while not call.turn():
        turns += 1
    return call.result(), turns


def flat(samples):
    return [(s.token_ids, s.logprobs, s.finish_reason) for per_prompt in samples for s in per_prompt]


@pytest.mark.parametrize("ending", ["length", "stop id", "stop string", "greedy"])
def test_turns_equal_an_uncut_call(backend, ending):
    """Seeded, over two batches (5 rows a batch), with rows that end early at different steps (a stop id, a stop
    string): every token, logprob and finish reason equal; the call took many turns."""
    params = SamplingParams(max_tokens=24, seed=3, temperature=0.0 if ending == "greedy" else 1.0)
    if ending in ("stop id", "stop string"):
        first = backend.generate(prompts(backend), params, 2)[0][0].token_ids
        if ending == "stop id":  # a token row 0 chooses at its 4th step: it (and others) end before the budget
            params = dataclasses.replace(params, stop_token_ids=(first[3],))
        else:
            params = dataclasses.replace(params, stop=(backend.tokenizer.decode(first[2:4]),))
    whole = backend.generate(prompts(backend), params, 2)
    cut, turns = in_turns(backend, params, 2, turn_s=0.0)  # one decode step a turn
    assert flat(cut) == flat(whole)
    assert turns >= 16
    if ending in ("stop id", "stop string"):
        reasons = [s.finish_reason for per_prompt in whole for s in per_prompt]
        lengths = {len(s.token_ids) for per_prompt in whole for s in per_prompt}
        assert {FinishReason.STOP, FinishReason.STOP_STRING} & set(reasons) and len(lengths) > 1  # ended early, apart


def test_a_waiting_seeded_call_keeps_its_stream_apart(backend):
    """Between the turns of a seeded call the process's random state is what it was before the turn: an
    unseeded draw there does not take the paused call's numbers, and the call's samples do not change."""
    params = SamplingParams(max_tokens=16, seed=11)
    whole = backend.generate(prompts(backend), params, 1)
    call = backend.turns(prompts(backend), params, 1, turn_s=0.0)
    torch.manual_seed(99)
    before = torch.get_rng_state()
    assert not call.turn()
    assert torch.equal(torch.get_rng_state(), before)
    torch.rand(1000)  # another user's unseeded sampling between the turns
    while not call.turn():
        torch.rand(10)
    assert flat(call.result()) == flat(whole)


def test_a_stopped_call_ends_at_its_next_turn(backend):
    """``stop`` True between turns: the samples end where they were (none past what was decoded), the call done."""
    asked = []
    call = backend.turns(prompts(backend), SamplingParams(max_tokens=40, seed=1), 1, stop=lambda: bool(asked),
                         turn_s=0.0)
    assert not call.turn()
    asked.append(True)
    assert call.turn()
    lengths = [len(s.token_ids) for per_prompt in call.result() for s in per_prompt]
    assert lengths == [1, 1, 1, 1]  # the one step of the turn before the stop


def test_a_turn_ends_at_its_first_step_past_its_time(backend):
    """A turn of 30 ms of a 48-token call: it ends with fewer tokens than the budget; the turns add up to the call."""
    params = SamplingParams(max_tokens=48, seed=2, ignore_eos=True)
    whole = backend.generate(prompts(backend), params, 1)
    call = backend.turns(prompts(backend), params, 1, turn_s=0.03)
    assert not call.turn()
    made = call.batch.made
    assert 1 <= made < 48
    while not call.turn():
        pass
    assert flat(call.result()) == flat(whole)


def test_a_turn_past_its_time_goes_on_while_nothing_else_wants_the_device(backend):
    """``wanted()`` False: a turn of no time decodes on to the batch's end; once it says True, turns of one step."""
    params = SamplingParams(max_tokens=12, seed=2, ignore_eos=True)
    wanted = [False]
    call = backend.turns(prompts(backend)[:2], params, 1, turn_s=0.0, wanted=lambda: wanted[0])
    assert call.turn()  # one batch (2 rows): done in one turn
    call = backend.turns(prompts(backend)[:2], params, 1, turn_s=0.0, wanted=lambda: wanted[0])
    wanted[0] = True
    assert not call.turn() and call.batch.made == 1


@pytest.mark.parametrize("ending", ["stop id", "stop string"])
def test_turns_of_a_few_tokens_show_each_sample_so_far(backend, ending):
    """``turn_tokens`` 3: each turn adds at most 3 tokens to a row; :meth:`Turns.sofar` after every turn is each
    row's sample so far (a prefix of the final one), its finish reason set once the row ended, and after the last
    turn the result itself (two batches: the rows of the second have no tokens until the first ended)."""
    params = SamplingParams(max_tokens=20, seed=5)
    first = backend.generate(prompts(backend), params, 2)[0][0].token_ids
    params = (dataclasses.replace(params, stop_token_ids=(first[4],)) if ending == "stop id"
              else dataclasses.replace(params, stop=(backend.tokenizer.decode(first[3:5]),)))
    whole = [s for per_prompt in backend.generate(prompts(backend), params, 2) for s in per_prompt]
    call = backend.turns(prompts(backend), params, 2, turn_tokens=3)
    before = [[] for _ in whole]
    seen_end = set()
    while not call.turn():
        now = call.sofar()
        for i, ((toks, reason), final) in enumerate(zip(now, whole)):
            assert len(toks) - len(before[i]) <= 3 and toks[:len(before[i])] == before[i]
            assert final.token_ids[:len(toks)] == toks
            if reason is not None:
                assert (toks, reason) == (final.token_ids, final.finish_reason)
                seen_end.add(reason)
            before[i] = toks
        if any(toks for toks, _ in now[5:]):  # the second batch (5 rows a batch) begins after the first ended
            assert all(reason is not None for _, reason in now[:5])
        else:
            assert all(reason is None for _, reason in now[5:])
    assert call.sofar() == [(s.token_ids, s.finish_reason) for s in whole]
    assert (FinishReason.STOP if ending == "stop id" else FinishReason.STOP_STRING) in seen_end  # seen mid-call
