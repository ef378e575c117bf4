"""Serve-mode throughput: N concurrent official `openai` clients against the endpoint, requests/s for the
`hf` engine (one request at a time), `vllm` one at a time (`max_batch` 1: the same engine unbatched) and
`vllm` with continuous batching. The model is the serve quickstart's (examples/serve_quickstart.yaml).

    .venv/bin/python benchmarks/serve.py --config examples/serve_quickstart.yaml --clients 8 --requests 16

Prints one JSON line per setting: requests/s, p50/p95 latency, the largest batch the engine stepped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai  # noqa: E402
from aiohttp import web  # noqa: E402

from rolectl.roles.config import load_config  # noqa: E402
from rolectl.roles.engines import make_rollout_engine, make_taskset  # noqa: E402
from rolectl.roles.serve.endpoint import ServeEndpoint  # noqa: E402
from rolectl.roles.serve.ledger import RewardLedger  # noqa: E402

__all__ = ["main"]


async def _measure(engine, prompts: list[str], *, label: str, clients: int, requests: int, max_batch: int) -> dict:
    ledger = RewardLedger(prefix="bench", group_size=engine.group_size, timeout_s=3600)
    endpoint = ServeEndpoint(engine, ledger, model_name="bench", api_key=None, max_queue=clients * 2,
                             max_batch=max_batch)
    runner = web.AppRunner(endpoint.app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    latencies: list[float] = []

    async def client(c: int) -> None:
        async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0) as oa:
            for r in range(requests):
                started = time.perf_counter()
                prompt = prompts[(c + r) % len(prompts)]
                await oa.chat.completions.create(model="bench", seed=c * 1000 + r,
                                                 messages=[{"role": "user", "content": prompt}])
                latencies.append(time.perf_counter() - started)

    try:
        await client(-1)  # warm-up, one request
        latencies.clear()
        started = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(clients)))
        elapsed = time.perf_counter() - started
    finally:
        await runner.cleanup()
        await endpoint.aclose()
    latencies.sort()
    return {"setting": label, "clients": clients, "requests": clients * requests,
            "requests_per_s": round(clients * requests / elapsed, 2),
            "latency_p50_s": round(statistics.median(latencies), 4),
            "latency_p95_s": round(latencies[int(0.95 * (len(latencies) - 1))], 4),
            "largest_batch": getattr(endpoint.runner, "largest_batch", 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/serve_quickstart.yaml")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=16, help="per client")
    parser.add_argument("--settings", default="hf,vllm-unbatched,vllm",
                        help="comma-separated: hf, vllm-unbatched, vllm")
    args = parser.parse_args()
    cfg = load_config(args.config)
    tasks = make_taskset(cfg, seed=0, batch_size=32).next_batch()
    engines: dict[str, object] = {}  # one engine per kind: both vLLM settings share one
    prompts: list[str] = []
    for setting in args.settings.split(","):
        kind = "hf" if setting == "hf" else "vllm"
        if kind not in engines:
            engines[kind] = make_rollout_engine(cfg.with_overrides(model=cfg.model.replace(rollout_engine=kind)),
                                                "explorer-0")
        engine = engines[kind]
        prompts = prompts or [engine.tokenizer.decode(list(t.prompt), skip_special_tokens=True) for t in tasks]
        figures = asyncio.run(_measure(engine, prompts, label=setting, clients=args.clients, requests=args.requests,
                                       max_batch=1 if setting == "vllm-unbatched" else 256))
        print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
