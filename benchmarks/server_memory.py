"""nats-server resident memory against the weight bytes its memory storage holds, per Go GOGC.

    python -m benchmarks.server_memory [--size-mb 512] [--gogc default 25 50] [--rounds 2]

Per GOGC value and round: a fresh embedded nats-server, three versions of `--size-mb` MiB published
through the object store (memory storage) and pruned to the newest two, one fetched; then the
server's `mem` (/varz, its RSS) and the stream's bytes (/jsz). Prints one JSON line each, with the
machine's load average (figures: docs/weights-at-size.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import urllib.request

import torch

__all__ = ["measure", "main"]


async def measure(size_mb: int, gogc: int | None) -> dict:
    import nats

    from rolectl.bus.server import NatsServer
    from rolectl.bus.weights.object_store import ObjectStoreTransport

    state = {"w": torch.ones(size_mb << 20, dtype=torch.uint8)}
    with tempfile.TemporaryDirectory(prefix="rolectl-server-memory-") as store:
        # go_gc=None with GOGC unset in our environment: Go's default (100)
        saved = os.environ.pop("GOGC", None)
        try:
            async with NatsServer(store_dir=store, go_gc=gogc) as server:
                nc = await nats.connect(server.url)
                transport = ObjectStoreTransport(nc, "server-memory")
                try:
                    for version in (1, 2, 3):
                        ref = await transport.publish(version, state)
                        await transport.prune(2)
                    del (await transport.fetch(ref))["w"]
                    with urllib.request.urlopen(f"{server.monitor_url}/varz", timeout=10) as resp:
                        varz = json.load(resp)
                    with urllib.request.urlopen(f"{server.monitor_url}/jsz", timeout=10) as resp:
                        jsz = json.load(resp)
                finally:
                    await transport.aclose()
                    await nc.close()
        finally:
            if saved is not None:
                os.environ["GOGC"] = saved
    return {"gogc": gogc or "default (100)", "size_mb": size_mb, "server_rss_mib": varz["mem"] >> 20,
            "stored_mib": jsz["memory"] >> 20, "rss_over_stored": varz["mem"] / max(jsz["memory"], 1),
            "loadavg_1m": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.server_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--gogc", nargs="+", default=["default", "25"], help="GOGC values ('default' = Go's 100)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    for _ in range(args.rounds):
        for value in args.gogc:
            print(json.dumps(asyncio.run(measure(args.size_mb, None if value == "default" else int(value)))),
                  flush=True)


if __name__ == "__main__":
    main()
