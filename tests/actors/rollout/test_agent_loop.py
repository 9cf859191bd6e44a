"""Agent loop on the real HF backend: masks, continuation tokens, limits, errors."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otray.actors.sampling.rollout import RolloutWorker
from otray.actors.rollout.agent_loop import AgentLoop, ChatContinuation, Limits
from otray.env import Env, StepResult
from otray.types import EnvStateError, SamplingParams, Task


class Chatter(Env):
    """Multi-turn: rewards 0.5 per turn, done after ``turns`` turns."""

    system_prompt = "Be brief."
    max_turns = 5

    def __init__(self, turns=3, fail_at=None):
        self.turns, self.fail_at, self.t = turns, fail_at, None

    def reset(self, task, seed=None):
        self.t = 0
        return f"Start {task.id}", {"seed": seed}

    def step(self, action):
        if self.t is None:
            raise EnvStateError("reset first")
        self.t += 1
        if self.fail_at == self.t:
            raise RuntimeError("env blew up")
        return StepResult(f"Turn {self.t} seen", 0.5, self.t >= self.turns, {"t": self.t})


@pytest.fixture(scope="module")
def worker(tiny_path):
    return RolloutWorker(tiny_path, "hf", max_model_len=256)


class Recorder:
    """Calls the real worker and keeps what it returned."""

    def __init__(self, worker):
        self.worker, self.calls = worker, []

    def __call__(self, prompts, params, n):
        out = self.worker.generate(prompts, params, n)
        self.calls.append((prompts, out))
        return out


def _run(worker, tokenizer, envs, limits, temperature=1.0):
    rec = Recorder(worker)
    loop = AgentLoop(tokenizer, rec, limits)
    trajs = loop.run([(Task(str(i), "chat"), e, i) for i, e in enumerate(envs)],
                     SamplingParams(max_tokens=limits.max_tokens_per_turn, temperature=temperature, seed=0))
    return trajs, rec


def test_masks_are_one_exactly_on_sampled_tokens(worker, tokenizer):
    limits = Limits(max_turns=5, max_tokens_per_turn=6, max_tokens_per_episode=100, max_model_len=256)
    trajs, rec = _run(worker, tokenizer, [Chatter(3), Chatter(2)], limits)
    cont = ChatContinuation(tokenizer)
    for i, traj in enumerate(trajs):
        assert traj.finished and not traj.truncated and traj.error is None
        assert traj.num_turns == len(traj.turn_rewards) == (3 if i == 0 else 2)
        # walk the token stream: prompt, then (sampled turn, observation) pairs
        samples = [out[j].samples[0] for prompts, out in rec.calls for j, p in enumerate(prompts)
                   if p == traj.token_ids[: len(p)]]
        pos = traj.prompt_len
        assert traj.loss_mask[:pos] == [0] * pos
        for k, s in enumerate(samples):
            n = len(s.token_ids)
            assert traj.token_ids[pos:pos + n] == s.token_ids, "sampled ids must be kept as sampled"
            assert traj.loss_mask[pos:pos + n] == [1] * n
            assert traj.logprobs[pos:pos + n] == s.logprobs
            pos += n
            if k < len(samples) - 1:
                stop = s.token_ids[-1] if s.finish_reason.value == "stop" else None
                obs = cont.ids(f"Turn {k + 1} seen", stop)
                assert traj.token_ids[pos:pos + len(obs)] == obs
                assert traj.loss_mask[pos:pos + len(obs)] == [0] * len(obs)
                pos += len(obs)
        assert pos == len(traj.token_ids)
        assert [m["role"] for m in traj.messages[:2]] == ["system", "user"]


def test_continuation_matches_the_chat_template(tokenizer):
    cont = ChatContinuation(tokenizer)
    eos = tokenizer.eos_token_id
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    full = tokenizer.encode(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)
    head = tokenizer.encode(tokenizer.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)
    b = tokenizer.encode("b", add_special_tokens=False)
    assert head + b + [eos] + cont.ids("c", eos) == full


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40), system=st.sampled_from([None, "", "Play well."]))
def test_cached_template_splits_give_the_templates_own_ids(tokenizer, text, system):
    """The prefix/suffix the continuation caches give exactly what rendering the template gives, for any
    user text (and for a template that is not verbatim, the slow path is taken)."""
    from otray.models import chat_prompt_ids

    cont = ChatContinuation(tokenizer)
    assert cont._next is not None  # the tiny model's template writes content verbatim: the fast path is tested
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    assert cont.first_ids(text, system) == chat_prompt_ids(tokenizer, messages)
    eos = tokenizer.eos_token_id
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "v"}]
    slow = tokenizer.apply_chat_template(base + [{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)
    head = tokenizer.apply_chat_template(base[:1], tokenize=False, add_generation_prompt=True)
    v = tokenizer.encode("v", add_special_tokens=False)
    assert tokenizer.encode(head, add_special_tokens=False) + v + [eos] + cont.ids(text, eos) == \
        tokenizer.encode(slow, add_special_tokens=False)


@settings(max_examples=40, deadline=None)
@given(texts=st.lists(st.sampled_from(["", " x", "<|im_end|>\n", "Board:\n. X O", "12+30="]) | st.text(max_size=20),
                      max_size=8))
def test_encode_many_gives_the_tokenizers_ids_through_its_cache(tokenizer, texts):
    """One batched call, repeated texts from the cache (also once it is emptied for being full): always the
    ids ``tokenizer.encode`` gives, and a caller that extends a returned list does not change the cache."""
    cont = ChatContinuation(tokenizer)
    cont.CACHE_TEXTS = 3
    want = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    for _ in range(2):
        got = cont.encode_many(texts)
        assert got == want
        for ids in got:
            ids.append(-1)
    assert len(cont._encoded) <= max(3, len(set(texts)))


def test_a_template_that_trims_content_takes_the_slow_path(tokenizer):
    import copy

    trimming = copy.deepcopy(tokenizer)
    trimming.chat_template = tokenizer.chat_template.replace("message['content']", "message['content'] | trim")
    assert trimming.chat_template != tokenizer.chat_template
    cont = ChatContinuation(trimming)
    assert cont._next is None and cont._first.get(None) is None
    from otray.models import chat_prompt_ids

    for text in ("  spaced  ", "x"):
        assert cont.first_ids(text) == chat_prompt_ids(trimming, [{"role": "user", "content": text}])


def test_limits_truncate_and_errors_are_recorded(worker, tokenizer):
    limits = Limits(max_turns=2, max_tokens_per_turn=4, max_tokens_per_episode=100, max_model_len=256)
    trajs, _ = _run(worker, tokenizer, [Chatter(turns=10), Chatter(turns=3, fail_at=1)], limits)
    never_done, failing = trajs
    assert never_done.truncated and not never_done.finished and never_done.num_turns == 2
    assert failing.error is not None and failing.error.kind == "env_exception"
    assert "env blew up" in failing.error.message
    # the token budget per episode also truncates
    tight = Limits(max_turns=5, max_tokens_per_turn=4, max_tokens_per_episode=6, max_model_len=256)
    (t,), _ = _run(worker, tokenizer, [Chatter(turns=10)], tight)
    assert t.truncated and t.num_sampled <= 6


def test_prompt_longer_than_context_becomes_an_error_record(worker, tokenizer):
    class Long(Chatter):
        def reset(self, task, seed=None):
            return "9" * 300, {}

    limits = Limits(max_turns=1, max_tokens_per_turn=4, max_tokens_per_episode=10, max_model_len=256)
    (bad, good), _ = _run(worker, tokenizer, [Long(), Chatter(turns=1)], limits)
    assert bad.error.kind == "prompt_too_long" and "context is 256" in bad.error.message
    assert good.error is None and good.finished
