"""The OpenAI request rules (pure) and the ModelServer's streaming against its complete answers (tiny model)."""

import asyncio

import pytest

from otray.serve.openai_api import APIError, Limits, apply_stop, chunk_body, parse_request, response_body, Choice

LIM = Limits(max_tokens=64, max_n=4, max_prompt_tokens=100)
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body, param", [
    ([], None), ({"messages": CHAT["messages"]}, "model"), ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "max_tokens": 65}, "max_tokens"), ({**CHAT, "max_tokens": 2.5}, "max_tokens"),
    ({**CHAT, "n": 5}, "n"), ({**CHAT, "n": True}, "n"), ({**CHAT, "temperature": 3}, "temperature"),
    ({**CHAT, "top_p": 0}, "top_p"), ({**CHAT, "stream": "yes"}, "stream"), ({**CHAT, "stop": ["a"] * 5}, "stop"),
    ({**CHAT, "stop": [""]}, "stop"), ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages[0]"),
    ({**CHAT, "messages": [{"role": "user"}]}, "messages[0]"), ({**CHAT, "logit_bias": {}}, "logit_bias"),
    ({**CHAT, "presence_penalty": 0.5}, "presence_penalty"), ({**CHAT, "stream_options": 3}, "stream_options"),
])
def test_bad_chat_requests_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        parse_request(body, chat=True, limits=LIM)
    assert e.value.status == 400 and e.value.param == param and e.value.body()["error"]["message"]


def test_good_requests_and_bodies():
    req = parse_request({**CHAT, "max_completion_tokens": 7, "n": 2, "stop": "\n", "seed": 3, "stream": True,
                         "stream_options": {"include_usage": True}, "user": "u", "presence_penalty": 0}, chat=True, limits=LIM)
    assert (req.max_tokens, req.n, req.stop, req.seed, req.stream, req.include_usage) == (7, 2, ["\n"], 3, True, True)
    comp = parse_request({"model": "tiny", "prompt": "1+1="}, chat=False, limits=LIM)
    assert comp.prompt == "1+1=" and comp.max_tokens == 16 and not comp.chat
    with pytest.raises(APIError, match="'prompt' must be a string"):
        parse_request({"model": "tiny", "prompt": [1, 2]}, chat=False, limits=LIM)
    body = response_body(req, [Choice("ab", "stop", 3), Choice("c", "length", 7)], prompt_tokens=5)
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15}
    assert [c["message"]["content"] for c in body["choices"]] == ["ab", "c"] and body["object"] == "chat.completion"
    first = chunk_body(req, "id", 1, 0, "x", None, first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "x"}
    assert apply_stop("abc\ndef", ["\n", "zz"]) == ("abc", True) and apply_stop("abc", ["x"]) == ("abc", False)


def test_streamed_text_equals_the_complete_answer(tiny_path):
    from otray.models import chat_prompt_ids
    from otray.serve.config import ServeModel
    from otray.serve.model_server import Job, ModelServer
    from otray.types import SamplingParams

    server = ModelServer(ServeModel(name="tiny", path=tiny_path, backend="hf", max_model_len=512), stream_chunk_tokens=3)
    for i in range(4):
        ids = chat_prompt_ids(server.tokenizer, [{"role": "user", "content": f"What is {i}+{i * 7}?"}])
        whole = server.complete(server.base, Job(ids, SamplingParams(max_tokens=20, temperature=0.0), 2, []))[0].text
        stop = [whole[len(whole) // 2: len(whole) // 2 + 2]] if len(whole) > 4 else []
        job = Job(ids, SamplingParams(max_tokens=20, temperature=0.0), 2, stop)
        expected = server.complete(server.base, job)

        async def collect():
            return [item async for item in server.stream(server.base, job)]

        items = asyncio.run(collect())
        for index in range(2):
            mine = [it for it in items if it[0] == index]
            assert "".join(text for _, text, _, _ in mine) == expected[index].text  # stop strings never leak
            assert mine[-1][2] == expected[index].finish_reason and all(f is None for _, _, f, _ in mine[:-1])


def test_dynamic_batching_shares_calls_and_keeps_answers(tiny_path, tokenizer):
    """Concurrent requests with equal settings share generate calls and get the answers they
    would get alone; a seeded request runs alone; one too-long prompt fails only itself."""
    import threading

    from otray.actors.sampling.backends.hf import HFBackend
    from otray.models import chat_prompt_ids
    from otray.serve.batching import Loaded
    from otray.types import SamplingParams

    backend = HFBackend(tiny_path, max_model_len=128)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": f"What is {i}+{2 * i}?"}]) for i in range(8)]
    alone = [backend.generate([p], greedy, 1)[0][0].token_ids for p in prompts]
    model = Loaded(backend, "tiny", max_batch=32)
    out: dict[int, list[int]] = {}
    errors: dict[int, BaseException] = {}
    jobs = [(i, p, greedy) for i, p in enumerate(prompts)] + [(8, [5] * 200, greedy)]  # 8: longer than the context

    def call(i, p, params):
        try:
            out[i] = model.generate([p], params, 1)[0][0].token_ids
        except Exception as e:  # noqa: BLE001
            errors[i] = e

    model.lock.acquire()  # hold the backend so every request queues, then let them go together
    threads = [threading.Thread(target=call, args=job) for job in jobs]
    for t in threads:
        t.start()
    while len(model.queue) < len(jobs):
        threading.Event().wait(0.01)
    model.lock.release()
    for t in threads:
        t.join(60)
    assert set(errors) == {8} and "128" in str(errors[8])
    assert [out[i] for i in range(8)] == alone
    assert max(model.batches) == 9  # all nine went into one call (which failed, then each ran alone)

    model.batches.clear()
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=3)
    model.lock.acquire()
    threads = [threading.Thread(target=call, args=(i, prompts[i], seeded)) for i in range(3)]
    for t in threads:
        t.start()
    while len(model.queue) < 3:
        threading.Event().wait(0.01)
    model.lock.release()
    for t in threads:
        t.join(60)
    assert list(model.batches) == [1, 1, 1]


def test_batch_wait_gathers_the_recent_load_and_a_lone_client_does_not_wait(tiny_path, tokenizer):
    import threading
    import time

    from otray.actors.sampling.backends.hf import HFBackend
    from otray.models import chat_prompt_ids
    from otray.serve.batching import Loaded
    from otray.types import SamplingParams

    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": f"What is {i}+{i}?"}]) for i in range(4)]
    backend = HFBackend(tiny_path, max_model_len=128)
    lone = Loaded(backend, "tiny", batch_wait_ms=1000)
    t0 = time.perf_counter()
    for p in prompts:  # one client, one request at a time: its load is 1, it never waits the second
        lone.generate([p], greedy, 1)
    assert time.perf_counter() - t0 < 1.0 and list(lone.batches) == [1, 1, 1, 1]

    model = Loaded(backend, "tiny", batch_wait_ms=1000)

    def clients(delay):
        threads = [threading.Thread(target=lambda i=i: (time.sleep(i * delay), model.generate([prompts[i]], greedy, 1)))
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)

    model.lock.acquire()  # four clients at once: one call of 4, and a load of 4 remembered
    threading.Timer(0.3, model.lock.release).start()
    clients(0.0)
    assert list(model.batches) == [4]
    model.batches.clear()
    t0 = time.perf_counter()
    clients(0.1)  # they come back 100 ms apart: the call waits for the fourth, not the whole second
    assert list(model.batches) == [4]
    assert time.perf_counter() - t0 < 0.95
