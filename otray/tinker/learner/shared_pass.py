"""One forward(_backward) pass over several clients' requests, each row through its own LoRA adapter.

A :class:`~otray.tinker.learner.passes.PassRequest` is one client's slice of work (adapter, datums, loss);
:class:`SharedPass` runs a list of them on the :class:`~otray.tinker.learner.adapter_learner.AdapterLearner`'s model: rows planned
into micro-batches, grouped by adapter (:func:`~otray.tinker.learner.mixed_lora.row_order`), one routed
forward (:class:`~otray.tinker.learner.mixed_lora.RowRouting`), each request's own loss (:func:`rows_loss`),
and one backward per micro-batch over the requests whose loss succeeded. A request whose loss raises
keeps its exception and its adapter no gradient; the others go on.

Runs in the SharedLearner actor of one base model."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from otray.actors.learner.core import (PAD_SPREAD, by_length, loss_inputs, micro_batches, token_logprobs,
                                       topk_logprobs, topk_weights)
from otray.algos.losses import per_token_loss
from otray.tinker.errors import AdapterGone
from otray.tinker.learner.loss_graph import LossGraph
from otray.tinker.learner.loss_run import add_sums, surrogate
from otray.tinker.learner.mixed_lora import RowRouting, groups_of, row_order
from otray.tinker.learner.pass_graphs import PassGraphs
from otray.tinker.learner.passes import PassNotRun, PassRequest, PassResult
from otray.types import Datum


def rows_loss(lp: torch.Tensor, valid: torch.Tensor, batch: list[Datum], device: str, loss_fn: str,
              cfg: dict[str, float], graph: Optional[LossGraph] = None) -> tuple[torch.Tensor, Optional[tuple[float, dict]]]:
    """Per-token losses (``(rows, T)``, zero past each row's end) of rows whose logprobs are ``lp``
    (``(rows, T)``, or ``(rows, T, K)`` for top-K datums). Top-K: ``-sum_k w_k * logprob(target_k)``. A custom
    loss (``graph``): its gradient's surrogate per token, and second its sum and metric sums."""
    if graph is not None:
        tok, loss_sum, metrics = surrogate(graph, batch, lp, device)
        return tok * valid, (loss_sum, metrics)
    if batch[0].target_k is not None:
        tok = -(topk_weights(batch, lp.shape[1], device) * lp).sum(-1)
    else:
        x = loss_inputs(batch, lp.shape[1], device, every_token=True)
        tok = per_token_loss(loss_fn, lp, x.sampler_logprobs, x.advantages, x.weights, **x.extras(), **cfg)
    return tok * valid, None


def batch_logprobs(model: torch.nn.Module, batch: list[Datum], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's logprobs: ``(rows, T)``, or ``(rows, T, K)`` for top-K datums; and the valid mask."""
    return (topk_logprobs if batch[0].target_k is not None else token_logprobs)(model, batch, device)


def batch_loss(model: torch.nn.Module, batch: list[Datum], device: str, loss_fn: str, cfg: dict[str, float],
               graph: Optional[LossGraph] = None) -> tuple[torch.Tensor, torch.Tensor, Optional[tuple[float, dict]]]:
    """One micro-batch's logprobs and per-token losses (:func:`rows_loss`; third a custom loss's sums)."""
    lp, valid = batch_logprobs(model, batch, device)
    tok, custom = rows_loss(lp, valid, batch, device, loss_fn, cfg, graph)
    return lp, tok, custom


@dataclass
class _Answer:
    """One request's answer, filled micro-batch by micro-batch."""

    logprobs: list
    losses: list
    total: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


class SharedPass:
    """Several requests (of one pack key, adapters that exist) in shared passes on ``model``: ``ranks`` (each
    adapter's rank, for grouping), ``params`` (an adapter's LoRA parameters). :meth:`run` gives each request
    a :class:`PassResult` or its exception; ``applied`` says whether any gradient was added. ``graphs``:
    micro-batches run as bucketed passes where they can (:class:`~otray.tinker.learner.pass_graphs.PassGraphs`)."""

    def __init__(self, model: Any, routing: RowRouting, device: str, micro_batch_tokens: int, ranks: dict[str, int],
                 params: Callable[[str], list[torch.nn.Parameter]], graphs: Optional[PassGraphs] = None):
        self.model, self.routing, self.device, self.graphs = model, routing, device, graphs
        self.micro_batch_tokens, self.ranks, self.params = micro_batch_tokens, ranks, params
        self.applied = False

    def run(self, requests: list[PassRequest]) -> list[PassResult | Exception]:
        """Each request's answer, or its exception: an AdapterGone for an adapter that is gone (unloaded, or the
        learner restarted). Raises :class:`PassNotRun` when the pass failed before adding any gradient."""
        out: list[Any] = [_Answer([None] * len(r.datums), [None] * len(r.datums)) if r.adapter in self.ranks
                          else AdapterGone(f"no adapter {r.adapter!r} on this learner (it was unloaded, or the "
                                           "learner restarted)") for r in requests]
        rows = [(i, j) for i, r in enumerate(requests) if isinstance(out[i], _Answer) for j in range(len(r.datums))]
        for name in {requests[i].adapter for i, _ in rows}:
            for p in self.params(name):
                p.requires_grad_(True)
        try:
            for chunk in self._plan([requests[i].datums[j] for i, j in rows]) if rows else []:
                names = [requests[rows[k][0]].adapter for k in chunk]
                key = row_order(collections.Counter(names), {n: self.ranks[n] for n in names}, self.routing.bank.slots)
                chunk.sort(key=lambda k: key(requests[rows[k][0]].adapter))
                self._micro_batch(requests, out, [rows[k] for k in chunk], requests[0].backward)
        except Exception as e:
            if not self.applied:
                raise PassNotRun(str(e)) from e
            raise
        return [PassResult(a.logprobs, a.losses, a.total, a.metrics) if isinstance(a, _Answer) else a for a in out]

    def _micro_batch(self, requests: list[PassRequest], out: list, rows: list[tuple[int, int]], backward: bool) -> None:
        """One micro-batch (``rows``: (request, datum), grouped by adapter): forward, the losses (one for all the
        requests of one built-in loss and config, :meth:`_loss_groups`), one backward; each answer's rows filled in."""
        batch = [requests[i].datums[j] for i, j in rows]
        owners = [i for i, _ in rows]
        with torch.set_grad_enabled(backward), self.routing.routed(groups_of([requests[i].adapter for i in owners])):
            bucketed = self.graphs.logprobs(batch, [requests[i].adapter for i in owners], backward) \
                if self.graphs is not None else None
            lp, valid = bucketed or batch_logprobs(self.model, batch, self.device)
            terms, parts = [], []
            todo = self._loss_groups(requests, [i for i in dict.fromkeys(owners) if not isinstance(out[i], Exception)])
            while todo:
                group = todo.pop(0)
                at = [k for k, o in enumerate(owners) if o in group]
                r = requests[group[0]]
                sel = (slice(None) if at == list(range(len(owners)))
                       else self.routing.const(tuple(at), torch.long, lp.device))
                try:
                    tok, custom = rows_loss(lp[sel], valid[sel], [batch[k] for k in at], self.device, r.loss_fn,
                                            r.loss_fn_config or {}, r.graph)
                except Exception as e:  # noqa: BLE001 - the requests' own loss: each fails alone
                    if len(group) > 1:
                        todo.extend([i] for i in group)
                    else:
                        out[group[0]] = e
                    continue
                terms.append(tok.sum())
                parts.append((at, tok, custom))
            if backward and terms:
                failed = {requests[i].adapter for i in dict.fromkeys(owners) if isinstance(out[i], Exception)}
                bare = [p for name in failed for p in self.params(name) if p.grad is None]
                self.applied = True
                torch.stack(terms).sum().backward()
                for p in bare:  # a failed request's rows passed zeros back: its adapter keeps no gradient
                    p.grad = None
        lp_host = lp.detach().cpu()  # one host copy per micro-batch, and one per loss
        for at, tok, custom in parts:
            tok_host = tok.detach().cpu()
            for i in dict.fromkeys(owners[k] for k in at):
                answer, mine = out[i], [n for n, k in enumerate(at) if owners[k] == i]
                answer.total += custom[0] if custom else float(tok_host[mine].sum())
                answer.metrics = add_sums(answer.metrics, custom[1] if custom else {})
                for n in mine:
                    k = at[n]
                    answer.logprobs[rows[k][1]] = lp_host[k, :len(batch[k])].reshape(-1).tolist()
                    answer.losses[rows[k][1]] = tok_host[n, :len(batch[k])].tolist()

    @staticmethod
    def _loss_groups(requests: list[PassRequest], live: list[int]) -> list[list[int]]:
        """The requests (indices into ``requests``) whose losses are computed together: one group per built-in
        loss and config (a loss's ops once for all their rows, not once per client); a custom loss alone."""
        groups: dict[Any, list[int]] = {}
        for i in live:
            r = requests[i]
            weighted = {d.weights is not None for d in r.datums}  # a batch's first datum says if it has weights
            key = ((r.loss_fn, tuple(sorted((r.loss_fn_config or {}).items())), weighted.pop())
                   if r.graph is None and len(weighted) == 1 else ("alone", i))
            groups.setdefault(key, []).append(i)
        return list(groups.values())

    def _plan(self, datums: list[Datum]) -> list[list[int]]:
        """Micro-batches of a shared pass, as lists of indices into ``datums``: one when they fit the token
        budget, else cut shortest first as ``plan_micro_batches`` cuts a call."""
        if max(len(d) for d in datums) * len(datums) <= self.micro_batch_tokens:
            return [list(range(len(datums)))]
        order = by_length(datums)
        chunks, at = [], 0
        for chunk in micro_batches([datums[i] for i in order], self.micro_batch_tokens, PAD_SPREAD):
            chunks.append(order[at:at + len(chunk)])
            at += len(chunk)
        return chunks
