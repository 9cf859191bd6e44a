"""Models and tokenizers: load from a local directory or hub id, LoRA, tiny model.

``build_tiny_model(path, seed)`` makes the model every test and demo uses: a small
Qwen2-architecture causal LM with a byte-level BPE tokenizer trained on synthetic
text that this module generates. Digits are split into single tokens (a probe here
found merged digits unlearnable for 2-digit addition at this size). The output is
byte-identical for the same seed and library versions, so every node of a cluster
can build the same model locally instead of copying it.

Command line: ``python -m otray.models tiny DIR [--seed N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otray.types import ModelLoadError

IM_START, IM_END, EOT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_SPEC = "tiny"
_TINY = re.compile(r"tiny(?:-([\w.]+))?(?::\d{1,9})?")
HUB_ONLY = "hub:"  # model.path "hub:org/name": a hub id that is never read from a local directory


def is_tiny_spec(spec: str) -> bool:
    """``tiny``, ``tiny:SEED``, ``tiny-SHAPE`` or ``tiny-SHAPE:SEED`` with a shape of :data:`SHAPES`."""
    m = _TINY.fullmatch(spec)
    return m is not None and (m.group(1) or "tiny") in SHAPES


@dataclass
class TinyShape:
    """Architecture of a generated model. The default is the ~0.7M-parameter tiny model.

    Four layers, not two: with two, SFT on 2-digit addition failed to "click" within
    750 steps for 2 of 3 seeds; with four it clicked for every seed tried (see README).
    """

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4  # head_dim = 32: vLLM's CPU attention needs >= 32
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    vocab_size: int = 512
    builder: str | None = None  # "module:fn" that builds this shape instead (the tiny VLM: otray.vlm)
    extra: dict[str, Any] = field(default_factory=dict)
    # raised when this shape's build changes: its cache directory's name carries it (``tiny-vl-seed0-r1``),
    # so a model built by an older otray is not reused
    revision: int = 0


SHAPES = {
    "tiny": TinyShape(),
    # the tiny model's language model in a Qwen2-VL, with a 2-block vision tower (otray.vlm)
    "vl": TinyShape(builder="otray.vlm:build_tiny_vlm", revision=1),  # 1: rotary base 10 (otray.vlm)
    # ~4.6M parameters: the tiny model twice as wide and 1.5x as deep, for games the tiny one plays too weakly
    # (benchmarks/gomoku_learning.py model.path=tiny-4m; docs/notes/learning.md)
    "4m": TinyShape(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
                    num_key_value_heads=2),
    # ~100M parameters, used by benchmarks/rollout_throughput.py.
    "100m": TinyShape(hidden_size=768, intermediate_size=2048, num_hidden_layers=16,
                      num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024),
    # Qwen2.5-0.5B's and -1.5B's transformer blocks (this tokenizer's 512-token vocabulary, so without
    # their 136M / 233M embedding parameters), for benchmarks/learner_scaling.py on a GPU.
    "0.5b": TinyShape(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=1024),
    "1.5b": TinyShape(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                      num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=1024),
    # Qwen2.5-0.5B's blocks with a 32k-entry byte-level BPE vocabulary (386M parameters: the embedding and
    # head cost what a real vocabulary's do in sampling), for benchmarks/gpu.py against TRL
    "0.5b_32k": TinyShape(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=1024,
                          vocab_size=32768),
}


# --------------------------------------------------------------------------- synthetic corpus

_WORDS = ("the answer is what sum of plus minus times number guess higher lower correct "
          "wrong tool call result total find compute value you are a helpful assistant "
          "please think step by then give final equals question add subtract multiply "
          "player move board win lose draw game turn choose arm reward").split()


def synthetic_corpus(seed: int, lines: int = 4000) -> list[str]:
    """Deterministic text covering what the bundled envs say: arithmetic and chat words."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        out.append(f"What is {a} {op} {b}? The answer is {a + b if op == '+' else a - b if op == '-' else a * b}.")
        out.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12))).capitalize() + ".")
    out.append('<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}</tool_call>')
    out.append("<move>E5</move> \\boxed{42} Higher. Lower. Correct!")
    return out


def pseudo_words(seed: int, vocab_size: int) -> list[str]:
    """Lines of made-up words (syllables of a consonant and a vowel), enough distinct ones for a BPE
    vocabulary of ``vocab_size`` entries (the bundled text alone gives a few thousand)."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(vocab_size * 2)]
    return [" ".join(rng.choice(words) for _ in range(16)) for _ in range(vocab_size // 2)]


def train_tokenizer(seed: int, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = synthetic_corpus(seed) + (pseudo_words(seed, vocab_size) if vocab_size > 4096 else [])
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=EOT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def build_tiny_model(path: str | os.PathLike, seed: int = 0, shape: str | TinyShape = "tiny") -> Path:
    """Build a randomly initialized Qwen2 model + tokenizer into ``path`` (HF format)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = SHAPES[shape] if isinstance(shape, str) else shape
    if spec.builder:
        from otray.structured import import_object

        return import_object(spec.builder)(path, seed, spec)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(seed, spec.vocab_size)
    im_end, eot = tokenizer.convert_tokens_to_ids([IM_END, EOT])
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=eot,
        eos_token_id=im_end,
        pad_token_id=eot,
        torch_dtype="float32",
        **spec.extra,
    )
    save_seeded(Qwen2ForCausalLM, config, tokenizer, path, seed)
    (path / "otray_tiny.json").write_text(json.dumps({"seed": seed, "shape": spec.__dict__}, sort_keys=True))
    return path


def save_seeded(model_class: Any, config: Any, tokenizer: Any, path: Path, seed: int) -> Any:
    """``model_class(config)`` initialized from ``seed`` (the process's RNG left alone), with the tiny
    tokenizer's end-of-turn ids as its generation defaults, saved with ``tokenizer`` into ``path``."""
    import torch
    from transformers import GenerationConfig

    im_end, eot = tokenizer.convert_tokens_to_ids([IM_END, EOT])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    model.generation_config = GenerationConfig(eos_token_id=[im_end, eot], pad_token_id=eot, bos_token_id=eot)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model


def resolve_model_path(spec: str, cache_dir: str | os.PathLike = ".cache/models") -> str:
    """Turn a config's ``model.path`` into a loadable path or hub id.

    ``tiny`` / ``tiny:SEED`` / ``tiny-100m:SEED`` build (once) into ``cache_dir``; ``hub:ORG/NAME``
    (what :mod:`otray.trust` makes of a user's hub id) is the hub id, refused when a local path of
    that name exists; anything else is returned unchanged (a local directory or a hub id).
    """
    if spec.startswith(HUB_ONLY):
        hub_id = spec.removeprefix(HUB_ONLY)
        if Path(hub_id).exists():
            raise ModelLoadError(f"model.path {hub_id!r} is a hub id, and a local path of that name exists here: "
                                 "a user's hub id is never loaded from a local directory; name another model, or "
                                 "ask an admin (whose paths load as given)")
        return hub_id
    if not spec.startswith(TINY_SPEC):
        return spec
    name, _, seed = spec.partition(":")
    shape = name.removeprefix("tiny").lstrip("-") or "tiny"
    if shape not in SHAPES:
        raise ModelLoadError(f"unknown tiny model shape {name!r}; use one of: " + ", ".join(
            "tiny" if s == "tiny" else f"tiny-{s}" for s in SHAPES))
    revision = SHAPES[shape].revision
    out = Path(cache_dir).absolute() / (f"{name}-seed{seed or 0}" + (f"-r{revision}" if revision else ""))
    if not (out / "config.json").exists():
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        build_tiny_model(tmp, int(seed or 0), shape)
        try:
            tmp.rename(out)
        except OSError:  # another process finished first; theirs is byte-identical
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


# --------------------------------------------------------------------------- loading


def _check_source(path: str) -> None:
    p = Path(path)
    looks_local = p.is_absolute() or path.startswith(".") or os.sep in path and not _looks_like_hub_id(path)
    if looks_local and not p.exists():
        raise ModelLoadError(
            f"model path {path!r} does not exist. Give a local Hugging Face model directory, a hub id, "
            f"or 'tiny' (otray builds a tiny model); `python -m otray.models tiny DIR` builds one by hand.")
    if p.exists() and not (p / "config.json").exists():
        raise ModelLoadError(f"{path!r} exists but holds no config.json: it is not a Hugging Face model directory")


def _looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not Path(path).exists() and not path.startswith((".", "/"))


# tokenizer classes that are transformers' plain fast tokenizer (v5 spells it TokenizersBackend)
_PLAIN_FAST = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(path: str):
    """Load a tokenizer from a local HF directory or hub id, with a clear error if absent.

    A local directory whose ``tokenizer_config.json`` names the plain fast tokenizer (otray's tiny
    models do) loads through that class: ``AutoTokenizer``'s import alone takes 2-3 s on a small CPU
    (it pulls every model's configuration), paid by every job driver; anything else goes through it."""
    _check_source(path)
    try:
        if _tokenizer_class(path) in _PLAIN_FAST:
            from transformers import PreTrainedTokenizerFast as loader
        else:
            from transformers import AutoTokenizer as loader
        tok = loader.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not load a tokenizer from {path!r}: {e}") from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _tokenizer_class(path: str) -> str | None:
    """The ``tokenizer_class`` a local model directory's ``tokenizer_config.json`` names, if any."""
    try:
        return json.loads((Path(path) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def load_model(path: str, dtype: str = "float32"):
    """Load a causal LM from a local HF directory or hub id (a vision-language model: its
    image-text-to-text class, :mod:`otray.vlm`)."""
    import torch
    from transformers import AutoModelForCausalLM

    _check_source(path)
    try:
        if is_vision_model(path):
            from transformers import AutoModelForImageTextToText

            return AutoModelForImageTextToText.from_pretrained(path, dtype=getattr(torch, dtype))
        return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not load a model from {path!r}: {e}") from e


def is_vision_config(config: Any) -> bool:
    """Whether a model config is a vision-language model's (it names an image token and a vision tower)."""
    return getattr(config, "vision_config", None) is not None and getattr(config, "image_token_id", None) is not None


def is_vision_model(path: str) -> bool:
    """Whether the model at ``path`` (a local directory or hub id) takes images (:mod:`otray.vlm`)."""
    local = Path(path) / "config.json"
    if not local.exists():
        from transformers import AutoConfig

        try:
            return is_vision_config(AutoConfig.from_pretrained(path))
        except (OSError, ValueError):
            return False  # the loader that follows names the problem
    try:
        config = json.loads(local.read_text())
    except (OSError, ValueError):
        return False
    return "vision_config" in config and "image_token_id" in config


@dataclass
class LoraSpec:
    rank: int = 0  # 0 = full-parameter training
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __post_init__(self) -> None:  # a config's list of modules, kept as a tuple
        self.target_modules = tuple(self.target_modules)


def apply_lora(model, spec: LoraSpec):
    """Wrap ``model`` in a PEFT LoRA adapter (only the adapter is trainable)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                        target_modules=list(spec.target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, config)


# what a model directory holds beside its weights and config: tokenizer, chat template, image processor
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "preprocessor_config.json", "processor_config.json", "otray_vision.json")


def copy_side_files(src: str | os.PathLike, out: str | os.PathLike) -> None:
    """Copy the :data:`SIDE_FILES` model directory ``src`` has into ``out`` (a checkpoint or export of its
    weights): what loading the checkpoint as a model, for sampling or serving, needs besides them."""
    import shutil

    for name in SIDE_FILES:
        if (Path(src) / name).exists():
            shutil.copy(Path(src) / name, Path(out) / name)


def end_of_turn_ids(tokenizer) -> list[int]:
    """Token ids that end an assistant turn: eos plus the chat end marker if present."""
    ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template (with ``tools``, for a
    template that takes them: see :func:`template_takes_tools`)."""
    extra = {"tools": [{"type": "function", "function": t} for t in tools]} if tools else {}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra)
    return tokenizer.encode(text, add_special_tokens=False)


def template_takes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders a ``tools=`` list (Qwen2.5's and Llama 3's do;
    otray's tiny model's does not: its envs' tools go into the system prompt)."""
    return "tools" in str(getattr(tokenizer, "chat_template", None) or "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m otray.models")
    sub = parser.add_subparsers(dest="cmd", required=True)
    tiny = sub.add_parser("tiny", help="build the tiny Qwen2 model + tokenizer into DIR")
    tiny.add_argument("dir")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    args = parser.parse_args(argv)
    out = build_tiny_model(args.dir, args.seed, args.shape)
    print(f"built {args.shape} model (seed {args.seed}) in {out}")


if __name__ == "__main__":
    main()
