"""What the two Tinker SDK examples share: the service, the arithmetic data, datums, evaluation.

Everything that talks to the service goes through the unmodified ``tinker`` SDK. The data
(2-digit addition, disjoint train/held-out problems) and the answer parser come from otray's
arithmetic env, as any user's own task code would.
"""

from __future__ import annotations

import os
import time
import urllib.request

import tinker
from tinker import types

from envs.arithmetic import make_problems, parse_answer

URL = os.environ.get("TINKER_BASE_URL", "http://127.0.0.1:8001")
NUM_EVAL = 500


def ensure_service(url: str = URL, base_model: str = "tiny", path: str = "tiny") -> None:
    """Use the Tinker API at ``url``; when nothing answers there, start one in this process (a local
    Ray, ``otray tinker`` with auth off: any ``tml-`` key) offering ``path`` as ``base_model``."""
    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    try:
        urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=2)
        return
    except OSError:
        pass
    import ray

    from otray.tinker.gateway.app import run
    from otray.tinker.config import load_tinker

    port = int(url.rsplit(":", 1)[1])
    ray.init(address=os.environ.get("RAY_ADDRESS", "local"), include_dashboard=False, log_to_driver=False)
    run(load_tinker({"port": port, "auth": "off", "storage": ".cache/tinker-examples",
                     "models": [{"name": base_model, "path": path, "learner_cpus": 1, "num_threads": 2}]}))
    print(f"started otray tinker at {url}", flush=True)


def split_problems() -> tuple[list[dict], list[dict]]:
    """(train, held-out): every 2-digit sum, shuffled, the first 500 held out (as `make demo`)."""
    rows = make_problems(0)
    return rows[NUM_EVAL:], rows[:NUM_EVAL]


def prompt_ids(tok, question: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def answer_ids(tok, answer: int) -> list[int]:
    """The answer and the end-of-turn marker the chat template closes an assistant turn with."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    return tok.encode(str(answer), add_special_tokens=False) + [end if isinstance(end, int) else tok.eos_token_id]


def sft_datum(tok, problem: dict) -> types.Datum:
    """Cross-entropy on the answer tokens only (weight 0 on the prompt)."""
    prompt, answer = prompt_ids(tok, problem["question"]), answer_ids(tok, problem["answer"])
    seq = prompt + answer
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                       loss_fn_inputs={"target_tokens": seq[1:],
                                       "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(answer)})


def mean_nll(tc, data: list[types.Datum]) -> float:
    """Mean negative log-likelihood per answer token (``forward``: no gradient)."""
    out = tc.forward(data, "cross_entropy").result()
    total = sum(-sum(lp * w for lp, w in zip(o["logprobs"].tolist(), d.loss_fn_inputs["weights"].tolist()))
                for d, o in zip(data, out.loss_fn_outputs))
    return total / sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in data)


def accuracy(sampler, tok, problems: list[dict]) -> float:
    """Greedy held-out accuracy: every prompt in flight at once (the service batches them)."""
    params = types.SamplingParams(max_tokens=6, temperature=0.0)
    futures = [sampler.sample(types.ModelInput.from_ints(prompt_ids(tok, p["question"])), 1, params) for p in problems]
    texts = [tok.decode(f.result().sequences[0].tokens, skip_special_tokens=True) for f in futures]
    return sum(parse_answer(t) == p["answer"] for t, p in zip(texts, problems)) / len(problems)


def training_client(base_model: str, rank: int, seed: int):
    service = tinker.ServiceClient(base_url=URL)
    return service, service.create_lora_training_client(base_model=base_model, rank=rank, seed=seed).result()


class Clock:
    def __init__(self) -> None:
        self.t0 = time.time()

    def __str__(self) -> str:
        return f"{time.time() - self.t0:6.1f}s"
