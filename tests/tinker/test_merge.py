"""The server-side LoRA merge's arithmetic (otray/tinker/service/merge.py), against PEFT's own forward pass: an
adapter on every linear layer (the tied lm_head included) folded into the tiny model gives a model that
transformers loads and that scores exactly as the base with the adapter on; what it cannot honour is
refused by name, and nothing is left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from otray.tinker.service.merge import lora_deltas, merge_lora
from otray.tinker.errors import UserError

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def adapter(tiny_path: str, where: Path, targets: list[str], **extra) -> torch.nn.Module:
    """A rank-4 LoRA with random (non-zero) A and B on ``targets``, saved as PEFT saves it; the PEFT model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_path),
                           LoraConfig(r=4, lora_alpha=8, target_modules=targets, **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.05)
    model.save_pretrained(str(where), save_embedding_layers=False)
    return model.eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([[1, 5, 9, 30, 7, 2, 11]])).logits[0].float()


@pytest.mark.parametrize("rslora", [False, True])
def test_a_merged_model_scores_as_the_base_with_its_adapter(tiny_path, tmp_path, rslora):
    from transformers import AutoModelForCausalLM

    peft_model = adapter(tiny_path, tmp_path / "lora", TARGETS, use_rslora=rslora)
    merged = merge_lora(Path(tiny_path), tmp_path / "lora", tmp_path / "model")
    assert merged["modules"] == 4 * 7 + 1 and merged["untied"] == ["lm_head"]  # 4 layers x 7 + the head
    assert merged["scale"] == pytest.approx(8 / 2 if rslora else 8 / 4)
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False  # the head has its own weight now; the embedding is the base's
    out = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model")).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_path).eval()
    assert torch.allclose(logits(out), logits(peft_model), atol=1e-4)
    assert not torch.allclose(logits(out), logits(base), atol=1e-2)  # the adapter did change something
    assert torch.equal(out.get_input_embeddings().weight, base.get_input_embeddings().weight)
    assert (tmp_path / "model" / "tokenizer.json").is_file() and not list(tmp_path.glob("model.partial-*"))


def test_an_untied_head_stays_tied_when_the_adapter_leaves_it(tiny_path, tmp_path):
    adapter(tiny_path, tmp_path / "lora", ["q_proj", "v_proj"])
    merged = merge_lora(Path(tiny_path), tmp_path / "lora", tmp_path / "model")
    assert merged["untied"] == [] and merged["modules"] == 8
    assert json.loads((tmp_path / "model" / "config.json").read_text()) == \
        json.loads((Path(tiny_path) / "config.json").read_text())


def test_a_sharded_base_merges_as_a_single_file_one(tiny_path, tmp_path):
    """A base in two shards with an index (as large models ship): the same merged weights, the head that the
    untying adds is in the index, and transformers loads the directory."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_path, sharded, ignore=shutil.ignore_patterns("*.safetensors"))
    weights = load_file(str(Path(tiny_path) / "model.safetensors"))
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in halves.items():
        save_file({k: weights[k] for k in keys}, str(sharded / shard), metadata={"format": "pt"})
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: shard for shard, keys in halves.items() for k in keys}}))
    adapter(tiny_path, tmp_path / "lora", TARGETS)
    merge_lora(Path(tiny_path), tmp_path / "lora", tmp_path / "one")
    merge_lora(sharded, tmp_path / "lora", tmp_path / "two")
    index = json.loads((tmp_path / "two" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(names) | {"lm_head.weight"}
    assert all(k in load_file(str(tmp_path / "two" / shard)) for k, shard in index.items())
    one, two = (AutoModelForCausalLM.from_pretrained(str(tmp_path / d)).eval() for d in ("one", "two"))
    assert torch.equal(logits(one), logits(two))


def test_a_tied_head_stored_in_the_file_too_is_untied(tiny_path, tmp_path):
    """Some tied checkpoints also store ``lm_head.weight``; transformers re-ties it on load, so the merge must
    untie the config there too, or the head's LoRA would be lost."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    shutil.copytree(tiny_path, base)
    weights = load_file(str(base / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    peft_model = adapter(tiny_path, tmp_path / "lora", ["lm_head"])
    assert merge_lora(base, tmp_path / "lora", tmp_path / "model")["untied"] == ["lm_head"]
    out = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model")).eval()
    assert torch.allclose(logits(out), logits(peft_model), atol=1e-4)


def test_what_the_merge_cannot_honour_is_refused_by_name(tiny_path, tmp_path):
    adapter(tiny_path, tmp_path / "lora", ["q_proj"])
    cfg_path = tmp_path / "lora" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key, value in [("use_dora", True), ("rank_pattern", {"q_proj": 8}), ("fan_in_fan_out", True)]:
        cfg_path.write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(UserError, match=key):
            lora_deltas(tmp_path / "lora")
    cfg_path.write_text(json.dumps(cfg))
    # an adapter trained on another base: its module names are not in this one
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tmp_path / "lora" / "adapter_model.safetensors"))
    save_file({k.replace("layers.0.", "layers.40."): v for k, v in weights.items()},
              str(tmp_path / "lora" / "adapter_model.safetensors"))
    with pytest.raises(UserError, match="trained on another base"):
        merge_lora(Path(tiny_path), tmp_path / "lora", tmp_path / "model")
    assert not (tmp_path / "model").exists() and not list(tmp_path.glob("model.partial-*"))
    # a base without safetensors, an adapter dir without its files
    bare = tmp_path / "bare"
    shutil.copytree(tiny_path, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(UserError, match="no safetensors"):
        merge_lora(bare, tmp_path / "lora", tmp_path / "model")
    with pytest.raises(UserError, match="no PEFT adapter"):
        lora_deltas(bare)


@pytest.mark.vllm
def test_vllm_serves_a_merged_model_as_transformers_does(tiny_path, tmp_path):
    """The merged directory (an untied head of its own) is a model vLLM loads: its greedy tokens are
    transformers' on the same directory, and not the base's."""
    from otray.actors.sampling.backends.hf import HFBackend
    from otray.actors.sampling.backends.vllm import VLLMBackend
    from otray.types import SamplingParams

    adapter(tiny_path, tmp_path / "lora", TARGETS)
    merge_lora(Path(tiny_path), tmp_path / "lora", tmp_path / "model")
    prompts, params = [[1, 5, 9, 30], [7, 2, 11]], SamplingParams(max_tokens=8, temperature=0.0)

    def greedy(backend) -> list[list[int]]:
        return [r[0].token_ids for r in backend.generate(prompts, params, 1)]

    engine = VLLMBackend(str(tmp_path / "model"), max_model_len=128)
    try:
        got = greedy(engine)
    finally:
        engine.shutdown()
    assert got == greedy(HFBackend(str(tmp_path / "model"), max_model_len=128))
    assert got != greedy(HFBackend(tiny_path, max_model_len=128))
