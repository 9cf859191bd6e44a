"""Sample requests, batched: those that arrive while a base model's learner is busy go to it in one
call, one ``generate`` per (sampler, settings) group, and each request's promise is finished with
its own protobuf result. A batch first waits ``sample_batch_wait_ms`` for the rest of the requests
a client sent together: without it the first of 8 concurrent requests went alone and the other 7
in a second call (benchmarks/tinker_api.py, RL step)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Optional

from otray.actors.adapters import SampleJob
from otray.tinker import runs as R
from otray.tinker.futures import Futures, Outcome
from otray.tinker.wire import sample_output


@dataclass
class SampleWait:
    """One checked ``asample`` request waiting for its learner."""

    request_id: str
    adapter: Optional[str]  # the sampler checkpoint's directory, None for the base model
    prompt: list[int]
    params: Any  # otray.types.SamplingParams (hashable: the grouping key)
    n: int
    prompt_logprobs: bool
    last_n: Optional[int]


class SampleBatcher:
    def __init__(self, learners: dict[str, Any], futures: Futures, wait_s: float):
        self.learners = learners
        self.wait_s = wait_s  # a batch waits this long for requests sent together (the SDK sends one per prompt)
        self.futures = futures
        self.waiting: dict[str, list[SampleWait]] = {m: [] for m in learners}
        self.busy: dict[str, bool] = {m: False for m in learners}
        self.calls: list[int] = []  # prompts per learner call, the latest 1,000 (batching, for benchmarks)

    def submit(self, base: str, wait: SampleWait) -> None:
        self.waiting[base].append(wait)
        if not self.busy[base]:
            self.busy[base] = True
            asyncio.get_running_loop().create_task(self._drain(base))

    async def _drain(self, base: str) -> None:
        try:
            while self.waiting[base]:
                await asyncio.sleep(self.wait_s)
                batch, self.waiting[base] = self.waiting[base], []
                groups: dict[tuple, list[SampleWait]] = {}
                for w in batch:
                    groups.setdefault((w.adapter, w.params, w.n, w.prompt_logprobs), []).append(w)
                jobs = [SampleJob(k[0], [w.prompt for w in ws], k[1], k[2], k[3]) for k, ws in groups.items()]
                self.calls = [*self.calls[-999:], sum(len(j.prompts) for j in jobs)]
                try:
                    results = await self.learners[base].sample.remote(jobs)
                except Exception as e:  # noqa: BLE001 - every waiting request learns why
                    for w in batch:
                        self.futures.finish(w.request_id, Outcome.error(R.cause(e), "server"))
                    continue
                for ws, outs in zip(groups.values(), results):
                    for w, out in zip(ws, outs):
                        lps = R.last_n(out.prompt_logprobs, w.last_n)
                        self.futures.finish(w.request_id, Outcome("proto", sample_output(out.samples, lps)))
        finally:
            self.busy[base] = False
