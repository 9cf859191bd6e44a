"""LoRA checkpoints served as adapters of one vLLM engine (ModelServer with ``max_lora_rank``):
the same greedy answers as the adapter merged into the base with transformers, batches that
mix several adapters, eviction that frees the engine's slot and the files,
and the merge fallback for a rank the engine has no slots for."""

import shutil
import threading
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

    # concurrent requests for both adapters and the base: the adapters share one engine call, the
    # base gets its own (vLLM's CPU build mixes a no-adapter prompt up with adapter prompts)
    server.base.batches.clear()
    results: dict[str, list[int]] = {}

    def ask(name, model):
        results[name] = model.generate(prompts[:1], greedy, 1)[0][0].token_ids

    threads = [threading.Thread(target=ask, args=(n, m)) for n, m in
               (("a1", adapters[0]), ("a2", adapters[1]), ("base", server.base))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(server.base.batches) == [1, 2]
    assert results == {"base": base[0], "a1": want[0][0], "a2": want[1][0]}

    # eviction (what Serve's LRU does): the engine drops the adapter before its next call, files go
    engine = server.base.backend.llm.llm_engine
    evicted = adapters[0].handle.lora_int_id
    assert evicted in engine.list_loras()
    adapters[0].__del__()
    server.base.generate(prompts[:1], greedy, 1)
    assert evicted not in engine.list_loras() and adapters[1].handle.lora_int_id in engine.list_loras()
    assert not (tmp_path / "a1").exists() and (tmp_path / "a2").exists()


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
