"""A small ``verifiers`` environment shipped with otray (``env_id: envs.vf_reverse_text``): reverse a short
lower-case word. Single turn; the rubric rewards the share of characters in place (1.0: exact). It is
written the way Environments Hub packages are (a module with ``load_environment``), so
``conf/verifiers_reverse.yaml`` trains on it through ``entry: verifiers`` like on any installed one."""

from __future__ import annotations

import random

import verifiers as vf
from datasets import Dataset

LETTERS = "abcdefgh"


def _words(seed: int, n: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    words = ["".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 4))) for _ in range(n)]
    return [{"question": f"Reverse: {w}", "answer": w[::-1]} for w in words]


def in_place(completion, answer, **kwargs) -> float:
    """The share of the answer's characters the reply has in the same place."""
    text = (completion[-1]["content"] if isinstance(completion, list) else completion) or ""
    text = text.strip()
    return sum(a == b for a, b in zip(text, answer)) / max(len(answer), len(text), 1)


def load_environment(num_train: int = 2000, num_eval: int = 200, seed: int = 0) -> vf.Environment:
    return vf.SingleTurnEnv(dataset=Dataset.from_list(_words(seed, num_train)),
                            eval_dataset=Dataset.from_list(_words(seed + 1, num_eval)),
                            system_prompt="Reply with the word reversed.",
                            rubric=vf.Rubric(funcs=[in_place]))
