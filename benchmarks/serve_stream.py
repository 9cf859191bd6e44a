"""Streamed answers against complete ones on a serving replica (tiny model, in-process ModelServer).

Ways to the same answers, side by side, alternating per round:

- ``complete``: ``ModelServer.complete`` as built: on HF one batched generate call per group of concurrent
  requests; on vLLM requests of the engine loop (otray/serve/engine_loop.py: continuous batching);
- ``turns``: ``ModelServer.stream`` as built: on HF each answer decoded in turns of ``--chunk`` tokens from its KV
  cache, concurrent streams with equal settings decoded together (otray/serve/streams.py); on vLLM a request of
  the engine loop, read as the engine's steps make its tokens;
- ``chunks``: ``ModelServer.stream`` the way before either (still the way of images on HF and the compiled
  sampler): a backend call per chunk over the prompt and every token so far (on vLLM through ``LLM.generate``,
  its prefix cache holding the prompt and the tokens so far);
- ``calls`` (vLLM only): complete answers the way before the engine loop: the batcher's ``LLM.generate`` calls.

On vLLM also ``late_request``: the seconds of a 16-token request that arrives 0.1 s into a 256-token one, joining
the engine loop against waiting for the call before it to end (``calls``).

Each client sends one sampled request (``ignore_eos``: every answer ``max_tokens`` long); reported per
``max_tokens`` and concurrency: the median seconds until every client has its whole answer, and each streaming
way over ``complete``, and the clients' median seconds to their first text. Saves
``benchmarks/results/serve_stream.json`` (``--backend vllm``: ``serve_stream_vllm.json``).

    python benchmarks/serve_stream.py [--tokens 64,256] [--clients 1,8] [--rounds 3] [--chunk 4] [--backend hf|vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import machine, save  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="64,256", help="max_tokens of each answer")
    ap.add_argument("--clients", default="1,8", help="concurrent requests")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=4, help="stream_chunk_tokens")
    ap.add_argument("--backend", choices=("hf", "vllm"), default="hf", help="the replica's backend")
    ap.add_argument("--out", default=None, help="default benchmarks/results/serve_stream[_vllm].json")
    args = ap.parse_args()

    import torch

    if args.backend == "hf":  # (vLLM's CPU attention takes the threads it planned for: left as they are)
        torch.set_num_threads(1)
    from otray.models import chat_prompt_ids
    from otray.serve.config import ServeModel
    from otray.serve.model_server import Job, ModelServer
    from otray.types import SamplingParams

    if args.backend == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    server = ModelServer(ServeModel(num_threads=1 if args.backend == "hf" else None, backend=args.backend,
                                    max_model_len=512),
                         str(ROOT / ".cache" / "models"), stream_chunk_tokens=args.chunk)
    turns, engine = server.base.streams, server.base.engine
    ways = ("complete", "turns", "chunks") + (("calls",) if engine is not None else ())

    def take(way: str) -> None:
        """The replica's model as ``way`` runs it (an idle engine loop may be set aside and back)."""
        before = way in ("chunks", "calls")  # the ways before the engine loop: calls of LLM.generate
        server.base.engine = None if before else engine
        server.base.streams = turns if way in ("turns", "complete") else None
    prompt = chat_prompt_ids(server.tokenizer, [{"role": "user", "content": "What is 12+30? Explain it step by step."}])

    async def one(way: str, tokens: int) -> tuple[int, float]:
        """The answer's tokens, and the seconds to its first text (a complete answer's: to the answer)."""
        job = Job(prompt, SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True), 1, [])
        t0 = time.perf_counter()
        take(way)
        if way in ("complete", "calls"):
            got = (await server.in_thread(server.complete, server.base, job))[0].completion_tokens
            return got, time.perf_counter() - t0
        got, first = 0, None
        async for _, _, _, so_far in server.stream(server.base, job):
            got, first = so_far, first if first is not None else time.perf_counter() - t0
        return got, first

    async def timed(way: str, tokens: int, clients: int) -> tuple[float, float]:
        """Seconds until every client has its whole answer, and the clients' median seconds to their first text."""
        t0 = time.perf_counter()
        got = await asyncio.gather(*[one(way, tokens) for _ in range(clients)])
        assert [n for n, _ in got] == [tokens] * clients, f"{way}: answers of {got} tokens, not {tokens}"
        return time.perf_counter() - t0, statistics.median(f for _, f in got)

    async def run() -> dict:
        rows = {}
        for tokens in map(int, args.tokens.split(",")):
            for clients in map(int, args.clients.split(",")):
                # each cell starts without the last cell's load (the batcher and the streams would wait up to
                # batch_wait_ms for that many requests until eight calls or groups had run with fewer)
                server.base.load.ends.clear()
                if turns is not None:
                    turns.load.ends.clear()
                await timed("complete", tokens, clients)  # warm
                seconds: dict[str, list[float]] = {way: [] for way in ways}
                firsts: dict[str, list[float]] = {way: [] for way in ways}
                for _ in range(args.rounds):
                    for way in seconds:
                        whole, first = await timed(way, tokens, clients)
                        seconds[way].append(whole)
                        firsts[way].append(first)
                med = {way: statistics.median(v) for way, v in seconds.items()}
                first = {way: statistics.median(v) for way, v in firsts.items()}
                row = {"seconds": seconds, "median_s": med, "first_text_s": first,
                       "chunks_over_complete": med["chunks"] / med["complete"]}
                line = (f"max_tokens {tokens:4}, {clients} client(s): complete {med['complete']:.3f} s, streamed in "
                        f"chunks {med['chunks']:.3f} s ({row['chunks_over_complete']:.2f}x, first text after "
                        f"{first['chunks'] * 1e3:.0f} ms)")
                row.update(turns_over_complete=med["turns"] / med["complete"],
                           chunks_over_turns=med["chunks"] / med["turns"])
                line += (f", in turns {med['turns']:.3f} s ({row['turns_over_complete']:.2f}x, first text after "
                         f"{first['turns'] * 1e3:.0f} ms): turns {row['chunks_over_turns']:.2f}x faster than chunks")
                if "calls" in med:
                    row["calls_over_complete"] = med["calls"] / med["complete"]
                    line += (f"; complete answers by LLM.generate calls {med['calls']:.3f} s "
                             f"({row['calls_over_complete']:.2f}x the engine loop's)")
                rows[f"{tokens}x{clients}"] = row
                print(line, flush=True)
        return rows

    async def late(way: str) -> float:
        """Seconds a 16-token request takes when it arrives 0.1 s into a 256-token one (complete answers)."""
        take(way)
        params = SamplingParams(max_tokens=256, temperature=1.0, ignore_eos=True)
        long = asyncio.ensure_future(server.in_thread(server.complete, server.base, Job(prompt, params, 1, [])))
        await asyncio.sleep(0.1)
        t0 = time.perf_counter()
        await server.in_thread(server.complete, server.base, Job(prompt, replace(params, max_tokens=16), 1, []))
        took = time.perf_counter() - t0
        await long
        return took

    async def joins() -> dict:
        got: dict[str, list[float]] = {"complete": [], "calls": []}
        for _ in range(args.rounds):
            for way in got:
                got[way].append(await late(way))
        med = {way: statistics.median(v) for way, v in got.items()}
        print(f"a 16-token request arriving 0.1 s into a 256-token one: {med['complete']:.3f} s joining the engine "
              f"loop, {med['calls']:.3f} s waiting for the call before it ({med['calls'] / med['complete']:.1f}x)",
              flush=True)
        return {"seconds": got, "median_s": med, "calls_over_complete": med["calls"] / med["complete"]}

    rows = asyncio.run(run())
    late_rows = asyncio.run(joins()) if engine is not None else None
    take("complete")
    out = args.out or str(ROOT / "benchmarks" / "results" / f"serve_stream{'_vllm' if engine is not None else ''}.json")
    save({"machine": machine(), "backend": args.backend, "chunk": args.chunk, "rounds": args.rounds, "rows": rows,
          **({"late_request": late_rows} if late_rows else {})}, out)


if __name__ == "__main__":
    main()
