"""A vLLM model on a ModelServer, its requests continuously batched by the engine loop (serve/engine_loop.py).

LoRA checkpoints served as adapters of one vLLM engine (``max_lora_rank``): the same greedy answers as the
adapter merged into the base with transformers, engine steps that mix several adapters (never an adapter and the
base), eviction that frees the engine's slot and the files, and the merge fallback for a rank the engine has no
slots for. Streams read from the engine's steps: a seeded stream equals its complete answer and is one engine
request; a request joins one that is decoding; a reader that leaves aborts its request; a bad prompt fails
alone; ``max_batch`` caps the sequences of a step."""

import asyncio
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm

QUESTIONS = ("12+34=", "What is 7*8?")


def _adapter(tiny_path, out: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter of the tiny model with random (non-zero) weights, saved as a checkpoint's
    ``model`` directory is."""
    from peft import LoraConfig, get_peft_model

    from otray.models import load_model

    torch.manual_seed(seed)
    model = get_peft_model(load_model(tiny_path, "float32"),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj", "up_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    model.save_pretrained(out)
    return out


def _merged_greedy(tiny_path, adapter_dir: Path, prompts, tmp: Path) -> list[list[int]]:
    from peft import PeftModel

    from otray.actors.sampling.backends.hf import HFBackend
    from otray.models import load_model
    from otray.types import SamplingParams

    merged = PeftModel.from_pretrained(load_model(tiny_path, "float32"), str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(tiny_path) / name).exists():
            shutil.copy(Path(tiny_path) / name, tmp / name)
    out = HFBackend(str(tmp), max_model_len=256).generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), 1)
    return [r[0].token_ids for r in out]


@pytest.fixture(scope="module")
def server(tiny_path):
    from otray.serve.config import ServeModel
    from otray.serve.model_server import ModelServer

    s = ModelServer(ServeModel(name="tiny", path=tiny_path, backend="vllm", max_model_len=256, max_lora_rank=8,
                               max_loaded_checkpoints=2, batch_wait_ms=300.0))
    yield s
    s.base.backend.shutdown()


def test_adapters_on_one_engine_match_merged_weights_and_share_batches(server, tiny_path, tokenizer, tmp_path):
    from otray.models import chat_prompt_ids
    from otray.serve.batching import Adapter
    from otray.types import SamplingParams

    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    dirs = [_adapter(tiny_path, tmp_path / f"a{i}" / "model", 8, seed=i) for i in (1, 2)]
    want = [_merged_greedy(tiny_path, d, prompts, tmp_path / f"merged{i}") for i, d in enumerate(dirs)]
    assert want[0] != want[1]
    adapters = []
    for i, d in enumerate(dirs):
        files = tmp_path / f"a{i + 1}"
        adapters.append(server.open_checkpoint(d, f"job-x:{i + 1}", str(files)))
    assert all(isinstance(a, Adapter) for a in adapters)
    base = [r[0].token_ids for r in server.base.generate(prompts, greedy, 1)]
    for a, expected in zip(adapters, want):
        got = [r[0].token_ids for r in a.generate(prompts, greedy, 1)]
        assert got == expected  # the engine's adapter = the adapter merged into the weights
        assert got != base

    # concurrent requests for both adapters and the base: the adapters share engine steps, the base's
    # never shares one with them (vLLM's CPU build mixes a no-adapter prompt up with adapter prompts)
    stepped = _watch_steps(server.base.engine)
    results: dict[str, list[int]] = {}

    def ask(name, model):
        results[name] = model.generate(prompts[:1], greedy, 1)[0][0].token_ids

    threads = [threading.Thread(target=ask, args=(n, m)) for n, m in
               (("a1", adapters[0]), ("a2", adapters[1]), ("base", server.base))]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join()
    assert results == {"base": base[0], "a1": want[0][0], "a2": want[1][0]}
    assert {"job-x:1", "job-x:2"} in [set(names) for names in stepped]  # the two adapters decoded together
    assert all(names == ["base"] or "base" not in names for names in stepped)

    # eviction (what Serve's LRU does): the engine drops the adapter before its next call, files go
    engine = server.base.backend.llm.llm_engine
    evicted = adapters[0].handle.lora_int_id
    assert evicted in engine.list_loras()
    adapters[0].__del__()
    server.base.generate(prompts[:1], greedy, 1)
    assert evicted not in engine.list_loras() and adapters[1].handle.lora_int_id in engine.list_loras()
    assert not (tmp_path / "a1").exists() and (tmp_path / "a2").exists()


def _watch_steps(loop) -> list[list[str]]:
    """Each engine step's requests from now on, by adapter name ("base": none), as the loop steps them."""
    stepped: list[list[str]] = []
    apply = loop._apply

    def watched(admit, aborts, news, error):
        flows = [f for f in list(loop.running.values()) + admit if f.id not in aborts and f.error is None]
        stepped.append(sorted("base" if f.adapter is None else f.adapter.lora_name for f in flows))
        return apply(admit, aborts, news, error)

    loop._apply = watched
    return stepped


def _stream(server, model, job) -> dict[int, tuple[str, str, int, int]]:
    """Each choice's streamed text, finish reason, tokens and chunks."""
    async def read():
        out: dict[int, tuple[str, str, int, int]] = {}
        async for i, text, finish, tokens in server.stream(model, job):
            got, _, _, chunks = out.get(i, ("", None, 0, 0))
            out[i] = (got + text, finish, tokens, chunks + 1)
        return out

    return asyncio.run(read())


def test_a_stream_is_one_engine_request_equal_to_its_complete_answer(server, tokenizer):
    from otray.models import chat_prompt_ids
    from otray.serve.model_server import Job
    from otray.types import SamplingParams

    loop = server.base.engine
    added = []
    add = loop.steps.add
    loop.steps.add = lambda *a, **k: added.append(a[0]) or add(*a, **k)
    try:
        job = Job(chat_prompt_ids(tokenizer, [{"role": "user", "content": QUESTIONS[1]}]),
                  SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True), 2, [])
        streamed = _stream(server, server.base, job)
        assert len(added) == 1  # one request, not a call per chunk over the prompt and the tokens so far
        complete = server.complete(server.base, job)
    finally:
        loop.steps.add = add
    assert [streamed[i][0] for i in range(2)] == [c.text for c in complete]
    assert all(streamed[i][1:3] == ("length", 24) and streamed[i][3] >= 3 for i in range(2))
    # a stop string ends a stream as it ends the complete answer
    one = server.complete(server.base, replace(job, n=1))[0].text
    word = next(one[i:i + 3] for i in range(4, len(one) - 3) if one[i:i + 3].isalpha())
    stop = replace(job, n=1, stop=[word])
    assert _stream(server, server.base, stop)[0][:2] == (one[:one.find(word)], "stop")
    assert server.complete(server.base, stop)[0].text == one[:one.find(word)]


def test_requests_join_the_engine_between_steps(server, tokenizer):
    from otray.models import chat_prompt_ids
    from otray.types import FinishReason, SamplingParams

    loop = server.base.engine
    loop.batches.clear()
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": QUESTIONS[0]}])
    long = loop.open(prompt, SamplingParams(max_tokens=120, temperature=1.0, ignore_eos=True), 1)
    seen, _, _ = loop.next(long, 0)
    short = loop.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), 1)
    version, sofar, finished = loop.next(long, seen)
    assert not finished and len(sofar[0][0]) < 120  # the short one joined the long one and ended first
    assert len(short[0][0].token_ids) == 4 and 2 in loop.batches
    # a reader that leaves: its request is aborted, the engine goes idle
    loop.close(long)
    deadline = time.time() + 10
    while (loop.running or loop.steps.busy) and time.time() < deadline:
        time.sleep(0.01)
    assert not loop.running and not loop.steps.busy and len(long.ids[0]) < 120
    with pytest.raises(RuntimeError, match="closed"):  # a thread still reading it is let go
        loop.next(long, 1 << 30)
    # a bad prompt fails alone, a good one beside it is answered
    bad = loop.open(list(prompt) * 100, SamplingParams(max_tokens=4), 1)
    good = loop.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), 1)
    with pytest.raises(Exception, match="context"):
        loop.next(bad, 0)
    assert good[0][0].finish_reason is FinishReason.LENGTH


def test_max_batch_and_seeds_bound_the_sequences_of_a_step(server, tokenizer):
    from otray.models import chat_prompt_ids
    from otray.types import SamplingParams

    loop = server.base.engine
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": QUESTIONS[0]}])
    free = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    loop.max_batch = 3
    try:
        loop.batches.clear()
        flows = [loop.open(prompt, free, 2) for _ in range(3)]  # 2 + 2 > 3: one request at a time
        while not all(f.done for f in flows):
            time.sleep(0.01)
        assert max(loop.batches) == 2 and all(len(f.ids[0]) == 12 for f in flows)
        loop.batches.clear()
        seeded = loop.open(prompt, replace(free, seed=3), 1)
        others = [loop.open(prompt, free, 1) for _ in range(2)]
        while not (seeded.done and all(f.done for f in others)):
            time.sleep(0.01)
        stepped = list(loop.batches)
        together = stepped.index(2)  # the seeded request alone, then the two others together
        assert together >= 12 and set(stepped[:together]) == {1} and len(seeded.ids[0]) == 12
    finally:
        loop.max_batch = 32


def test_an_adapter_above_the_engine_rank_is_merged_instead(server, tiny_path, tokenizer, tmp_path):
    from otray.models import chat_prompt_ids
    from otray.serve.batching import Loaded
    from otray.types import SamplingParams

    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": QUESTIONS[0]}])]
    big = _adapter(tiny_path, tmp_path / "big" / "model", 16, seed=3)
    model = server.open_checkpoint(big, "job-x:3", str(tmp_path / "big"))
    assert isinstance(model, Loaded) and model.backend.name == "hf"
    got = model.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), 1)[0][0].token_ids
    assert got == _merged_greedy(tiny_path, big, prompts, tmp_path / "merged-big")[0]
