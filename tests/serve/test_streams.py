"""Streamed answers decoded in turns (otray/serve/streams.py) on the ModelServer's HF model: the prompt computed
once, a seeded stream equal to its complete answer, concurrent streams decoded together, a reader that leaves."""

import asyncio
import threading

import pytest

from otray.models import chat_prompt_ids
from otray.serve.config import ServeModel
from otray.serve.model_server import Job, ModelServer
from otray.types import SamplingParams


@pytest.fixture(scope="module")
def server(tiny_path):
    return ModelServer(ServeModel(name="tiny", path=tiny_path, backend="hf", max_model_len=256, batch_wait_ms=0),
                       stream_chunk_tokens=4)


def ask(server, i):
    return chat_prompt_ids(server.tokenizer, [{"role": "user", "content": f"What is {i}+{i * 3}?"}])


def streamed(server, job, model=None):
    async def collect():
        return [item async for item in server.stream(model or server.base, job)]

    items = asyncio.run(collect())
    return [("".join(t for c, t, _, _ in items if c == k), [f for c, _, f, _ in items if c == k][-1],
             [n for c, _, _, n in items if c == k][-1]) for k in range(job.n)]


class Positions:
    """Counts the positions the model computes (each forward's input width times its rows)."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.count += ids.shape[0] * ids.shape[1]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def test_a_stream_computes_its_prompt_once_and_a_seeded_one_equals_its_complete_answer(server):
    """Two sampled choices, seeded, 40 tokens in chunks of 4: the text, finish reason and token count of each
    equal the complete answer's; the model computed the prompt's positions once per row (a chunk a call of its
    own, the way before turns, recomputes the prompt and the tokens so far for each chunk: 10 times here)."""
    prompt = ask(server, 5)
    job = Job(prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=7, ignore_eos=True), 2, [])
    whole = server.complete(server.base, job)
    with Positions(server.base.backend.model) as seen:
        got = streamed(server, job)
    assert [(c.text, c.finish_reason, c.completion_tokens) for c in whole] == got
    assert all(n == 40 for _, _, n in got)
    assert seen.count <= 2 * (len(prompt) + 40)  # each row: its prompt once, then a position per new token

    chunks = server.base.streams
    server.base.streams = None  # the chunked way, for the comparison
    try:
        with Positions(server.base.backend.model) as again:
            streamed(server, job)
    finally:
        server.base.streams = chunks
    assert again.count > 5 * seen.count


def test_concurrent_streams_decode_together_and_answer_as_alone(server):
    """Four readers whose streams queue together share one call (one group); each greedy answer is what it
    is alone; a fifth with other settings streams in a group of its own."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = [ask(server, i) for i in range(4)]
    alone = [server.complete(server.base, Job(p, greedy, 1, []))[0].text for p in prompts]
    other = SamplingParams(max_tokens=6, temperature=0.0)
    turns = server.base.streams
    streams = [turns.open(p, greedy, 1, 4) for p in prompts] + [turns.open(prompts[0], other, 1, 4)]
    texts: dict[int, list[int]] = {}

    def read(k):
        seen, finished = 0, False
        while not finished:
            seen, sofar, finished = turns.next(streams[k], seen)
        texts[k] = sofar[0][0]
        turns.close(streams[k])

    threads = [threading.Thread(target=read, args=(k,)) for k in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len({id(s.group) for s in streams[:4]}) == 1 and streams[4].group is not streams[0].group
    assert [s.first for s in streams[:4]] == sorted(s.first for s in streams[:4]) and not turns.queue
    assert [server.tokenizer.decode(texts[k], skip_special_tokens=True) for k in range(4)] == alone
    assert len(texts[4]) <= 6


def test_a_reader_that_leaves_does_not_stop_the_others(server):
    """One of two streams in a group closes after its first turn; the other reads on to its full answer, and a
    stream closed before its group formed leaves the queue."""
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    turns = server.base.streams
    a, b = turns.open(ask(server, 1), greedy, 1, 4), turns.open(ask(server, 2), greedy, 1, 4)
    seen, _, finished = turns.next(a, 0)
    assert b.group is a.group and not finished
    turns.close(a)
    seen, sofar, finished = turns.next(b, 0)  # the turn a's reader ran: b takes it without another
    assert seen == 1 and len(sofar[0][0]) == 4
    while not finished:
        seen, sofar, finished = turns.next(b, seen)
    assert len(sofar[0][0]) == 16 and seen == 4
    gone = turns.open(ask(server, 3), greedy, 1, 4)
    turns.close(gone)
    assert gone not in turns.queue


def test_a_prompt_that_cannot_start_fails_only_its_own_reader(server):
    """A stream whose prompt is past the context queued with a good one: the good one streams its answer, the
    bad one's reader gets the error that names the limit."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    turns = server.base.streams
    good, bad = turns.open(ask(server, 1), greedy, 1, 4), turns.open([5] * 300, greedy, 1, 4)
    seen, finished = 0, False
    while not finished:
        seen, sofar, finished = turns.next(good, seen)
    assert len(sofar[0][0]) == 8 and bad.group is not good.group
    with pytest.raises(ValueError, match="256"):
        turns.next(bad, 0)


def test_the_chunked_way_streams_the_complete_answer_too(server):
    """Without turns (vLLM, images, the compiled sampler), a chunk a call: greedy text with a stop string equal
    to the complete answer."""
    prompt = ask(server, 4)
    whole = server.complete(server.base, Job(prompt, SamplingParams(max_tokens=20, temperature=0.0), 1, []))[0].text
    stop = [whole[len(whole) // 2:len(whole) // 2 + 2]] if len(whole) > 4 else []
    job = Job(prompt, SamplingParams(max_tokens=20, temperature=0.0), 1, stop)
    expected = server.complete(server.base, job)[0]
    chunks = server.base.streams
    server.base.streams = None
    try:
        got = streamed(server, job)
    finally:
        server.base.streams = chunks
    assert got[0][:2] == (expected.text, expected.finish_reason)
