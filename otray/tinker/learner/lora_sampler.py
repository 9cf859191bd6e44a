"""LoraSampler: a vLLM engine that samples from many LoRA sampler checkpoints of one base model.

The Tinker service's fast sampling path (:mod:`otray.tinker.service.sampling` routes to it). Where the
:class:`~otray.tinker.learner.adapter_learner.AdapterLearner` samples with HF ``generate`` between training calls,
this actor runs one vLLM engine beside it: each sampler checkpoint (a PEFT directory written by
``AdapterLearner.save``) becomes a vLLM LoRA adapter, and one engine call serves prompts of several
adapters and of the base model at once (vLLM's multi-LoRA batching).

What vLLM serves: adapters on the attention and MLP projections up to ``max_lora_rank``. vLLM has no
LoRA on the unembedding (``lm_head``), so a checkpoint with ``train_unembed`` stays on the learner's
HF path (the service decides; :func:`serves`).

A checkpoint directory can be written again (``save_weights_for_sampler`` with a name used before):
an adapter is known by its directory *and* the file's modification stamp, so new weights get a new
vLLM adapter id and the old one is dropped: no sample ever comes from stale weights.

Runs in the LoraSampler actor (one vLLM engine per base model), started by the service."""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path
from typing import Any, Optional

from otray.tinker.learner.specs import AdapterSpec
from otray.tinker.learner.sample_jobs import SampleJob, SampleOut, checkpoint_version

# the projections vLLM can put LoRA on (its error names these when given others)
VLLM_TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


def checkpoint_spec(path: str) -> AdapterSpec:
    """The :class:`AdapterSpec` an AdapterLearner saved with the checkpoint at ``path``."""
    return AdapterSpec(**json.loads((Path(path) / "otray_adapter.json").read_text())["spec"])


def serves(spec: AdapterSpec, max_lora_rank: int) -> bool:
    """Whether a vLLM engine with LoRA slots of ``max_lora_rank`` can sample this adapter exactly."""
    return spec.rank <= max_lora_rank and set(spec.target_modules()) <= VLLM_TARGETS


class LoraSampler:
    """Ray actor (one per base model): vLLM generate and prompt logprobs for sampler checkpoints."""

    def __init__(self, model_path: str, *, max_lora_rank: int, max_loras: int, max_model_len: Optional[int] = None,
                 kv_cache_gb: int = 1, num_threads: Optional[int] = None,
                 gpu_memory_utilization: Optional[float] = None):
        from otray.actors.sampling.backends.vllm import VLLMBackend

        if num_threads:
            import torch

            torch.set_num_threads(num_threads)
        self.max_loras = max(1, max_loras)
        self.backend = VLLMBackend(model_path, max_lora_rank=max_lora_rank, max_loras=self.max_loras,
                                   max_model_len=max_model_len, kv_cache_gb=kv_cache_gb,
                                   gpu_memory_utilization=gpu_memory_utilization)
        # checkpoint dir -> (its weights file's stamp, the vLLM handle); least recently used first
        self.loaded: collections.OrderedDict[str, tuple[tuple[int, int], Any]] = collections.OrderedDict()
        self.prompts = 0  # prompts sampled (tests and benchmarks read it)
        self.versions: dict[str, Optional[int]] = {}  # checkpoint dir -> the version of its weights loaded

    def ping(self) -> bool:
        return True

    def served(self) -> int:
        return self.prompts

    def _adapter(self, path: Optional[str]) -> Any:
        """The vLLM handle of the checkpoint at ``path`` as it is on disk now (None: the base model)."""
        if path is None:
            return None
        st = os.stat(Path(path) / "adapter_model.safetensors")
        stamp = (st.st_mtime_ns, st.st_size)
        held = self.loaded.get(path)
        if held is not None and held[0] == stamp:
            self.loaded.move_to_end(path)
            return held[1]
        if held is not None:  # the directory was written again: its old weights must not be sampled
            self.backend.remove_adapter(self.loaded.pop(path)[1])
        while len(self.loaded) >= 4 * self.max_loras:  # vLLM reloads an evicted id from its path; bound the list
            self.backend.remove_adapter(self.loaded.popitem(last=False)[1][1])
        handle = self.backend.add_adapter(Path(path).name, path)
        self.loaded[path] = (stamp, handle)
        self.versions[path] = checkpoint_version(path)
        return handle

    def sample(self, jobs: list[SampleJob]) -> list[list[SampleOut]]:
        """As :meth:`AdapterLearner.sample`: per job, per prompt, ``n`` samples (and prompt logprobs).
        Adapter jobs with the same settings share one engine call whatever their adapters; the base
        model's prompts get calls of their own (vLLM's CPU build sampled a no-adapter prompt wrongly
        when it was batched with adapter prompts, in session 6; not seen since, the split is kept)."""
        rows = [(j, i, self._adapter(job.adapter)) for j, job in enumerate(jobs) for i in range(len(job.prompts))]
        samples: dict[tuple[int, int], list[Any]] = {}
        groups: dict[tuple[Any, int], list[tuple[int, int, Any]]] = {}
        for row in rows:
            groups.setdefault((jobs[row[0]].params, jobs[row[0]].n, row[2] is None), []).append(row)
        for (params, n, _), group in groups.items():
            got = self.backend.generate([jobs[j].prompts[i] for j, i, _ in group], params, n,
                                        adapters=[h for _, _, h in group])
            samples.update(((j, i), s) for (j, i, _), s in zip(group, got))
        scored = [row for row in rows if jobs[row[0]].scoring.prompt_logprobs]
        lps = dict(zip([(j, i) for j, i, _ in scored], self.backend.prompt_logprobs(
            [jobs[j].prompts[i] for j, i, _ in scored], [h for _, _, h in scored]))) if scored else {}
        self.prompts += len(rows)
        return [[SampleOut(samples[j, i], lps.get((j, i)), version=self.versions.get(job.adapter) if job.adapter else None)
                 for i in range(len(job.prompts))]
                for j, job in enumerate(jobs)]

    def shutdown(self) -> None:
        self.backend.shutdown()
