"""The trainer's intake of multi-turn trajectories against single-turn experiences of the same size.

    python -m benchmarks.trajectories [--explorers 16] [--steps 8] [--turns 8] [--repeat 3] [--json F]

16 explorers (`--explorers`) each publish `--steps` batches of `--tasks` groups of `--group-size`
episodes to a real nats-server (file storage, the job's experience stream); then the trainer's side
takes them in as `rolectl start trainer` does: `ExperienceReader.fetch` (8 messages a call) decodes
each batch and checks it against the engine's `ExperienceLimits` (`validate_batch`), every message
is acked, and each train step's worth of experiences becomes a `TrainBatch` (`experience_batch`:
masks, old logprobs, advantages). Three shapes of the same tokens per episode:

- `single-turn`: a prompt and one response, every response token sampled (schema 1);
- `multi-turn`: the same prompt, then `--turns` turns with an observation between each two
  (loss mask 0 on it; schema 2), as many response tokens in all;
- `multi-turn, split`: the same, on a stream whose `max_msg_size` is under a batch, so each batch
  travels one message per group.

Reports, best of `--repeat` (shapes interleaved), the intake rate in episodes/s and tokens/s (prompt
and response) and the trainer process's CPU per episode, and the multi-turn rates as a fraction of
the single-turn one (the goal: at least 0.8), by the clock and by CPU (on a shared machine the
clock follows the load; CPU per episode less so). The last line is JSON (also written to `--json`),
with the load average it ran under.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import time
from pathlib import Path

from rolectl.bus.connection import connect
from rolectl.bus.experiences import ExperienceBatch, ExperiencePublisher, ExperienceReader, encode_batch
from rolectl.bus.logging import setup_logging
from rolectl.bus.server import NatsServer
from rolectl.bus.streams import ensure_experience_stream
from rolectl.sync_protocol.experience import Experience, ExperienceLimits

__all__ = ["main", "measure"]

VOCAB = 151_936  # Qwen2.5's: token ids as a real model's
_PUBLISH_IN_FLIGHT = 64


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def episode(shape: str, index: int, *, prompt: int, turn: int, observation: int, turns: int) -> dict:
    """One episode's fields: `turns` turns of `turn` sampled tokens with `observation` tokens between
    each two, or (single-turn) one response of as many tokens."""
    length = turns * turn + (turns - 1) * observation
    response = tuple((index * 7919 + 13 * i) % VOCAB for i in range(length))
    fields = dict(prompt=tuple((index + i) % VOCAB for i in range(prompt)), response=response,
                  reward=(index % 5) / 4)
    if shape == "single-turn":
        return {**fields, "logprobs": tuple(-0.5 - (i % 7) / 8 for i in range(length))}
    mask = tuple(1 if i % (turn + observation) < turn else 0 for i in range(length))
    return {**fields, "loss_mask": mask,
            "logprobs": tuple(-0.5 - (i % 7) / 8 if m else 0.0 for i, m in enumerate(mask))}


def batches(shape: str, *, explorers: int, steps: int, tasks: int, group_size: int, **sizes: int
            ) -> list[ExperienceBatch]:
    out = []
    for e in range(explorers):
        member = f"explorer-{e}"
        for step in range(1, steps + 1):
            experiences = []
            for t in range(tasks):
                group = f"{member}-{step}-{t}"
                for k in range(group_size):
                    fields = episode(shape, (e * steps + step) * 1000 + t * group_size + k, **sizes)
                    experiences.append(Experience(id=f"{group}-{k}", group=group, model_version=step - 1, **fields))
            out.append(ExperienceBatch(member=member, explore_step=step, model_version=step - 1,
                                       experiences=tuple(experiences)))
    return out


async def _publish(conn, all_batches: list[ExperienceBatch]) -> None:
    publishers = {b.member: ExperiencePublisher(conn, b.member) for b in all_batches}
    for i in range(0, len(all_batches), _PUBLISH_IN_FLIGHT):
        window = all_batches[i:i + _PUBLISH_IN_FLIGHT]
        await asyncio.gather(*(publishers[b.member].publish(b) for b in window))


async def _intake(conn, limits: ExperienceLimits, expected: int, step_size: int) -> tuple[float, float, int]:
    """(wall s, CPU s, messages) to fetch, decode, validate, ack and batch `expected` experiences."""
    from rolectl.roles.engines.grpo import token_group_advantages
    from rolectl.roles.engines.losses import experience_batch

    reader = ExperienceReader(conn, ack_wait_s=600, limits=limits)
    taken: list[Experience] = []
    messages = count = 0
    wall, cpu = time.perf_counter(), _cpu_s()
    async with reader:
        while count < expected:
            received = await reader.fetch(8, timeout=5)
            if not received:
                raise RuntimeError(f"the stream ran dry after {count} of {expected} experiences")
            messages += len(received)
            for msg in received:
                taken.extend(msg.batch.experiences)
                count += len(msg.batch.experiences)
            await asyncio.gather(*(msg.ack() for msg in received))
            while len(taken) >= step_size:  # a train step's worth: what the engine builds first
                experience_batch(taken[:step_size], token_group_advantages)
                del taken[:step_size]
        if reader.rejected:
            raise RuntimeError(f"{reader.rejected} batches were refused: the benchmark's batches do not fit")
    return time.perf_counter() - wall, _cpu_s() - cpu, messages


async def measure(url: str, shape: str, *, run: int, explorers: int, steps: int, tasks: int, group_size: int,
                  max_msg_size: int | None, **sizes: int) -> dict:
    all_batches = batches("single-turn" if shape == "single-turn" else "multi-turn", explorers=explorers,
                          steps=steps, tasks=tasks, group_size=group_size, **sizes)
    count = sum(len(b.experiences) for b in all_batches)
    payload = sum(len(encode_batch(b)) for b in all_batches)
    response = len(all_batches[0].experiences[0].response)
    limits = ExperienceLimits(vocab_size=VOCAB, prompt_length=None, max_response_length=response,
                              group_size=group_size)
    job = f"traj-{os.getpid()}-{run}-{shape.replace(' ', '').replace(',', '-')}"
    async with connect(url, job=job, role="trainer", member="trainer") as conn:
        await ensure_experience_stream(conn.js, conn.names, max_bytes=4 * payload,
                                       **({"max_msg_size": max_msg_size} if max_msg_size else {}))
        await _publish(conn, all_batches)
        wall, cpu, messages = await _intake(conn, limits, count, tasks * group_size * 4)
        await conn.js.delete_stream(conn.names.experience_stream)
    tokens = count * (sizes["prompt"] + response)
    return {"shape": shape, "episodes": count, "tokens": tokens, "messages": messages, "payload_bytes": payload,
            "wall_s": wall, "cpu_s": cpu, "episodes_per_s": count / wall, "tokens_per_s": tokens / wall,
            "cpu_us_per_episode": cpu / count * 1e6, "tokens_per_cpu_s": tokens / cpu}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--explorers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8, help="batches per explorer")
    parser.add_argument("--tasks", type=int, default=4, help="groups per batch")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--turn", type=int, default=48, help="sampled tokens per turn")
    parser.add_argument("--observation", type=int, default=32, help="environment tokens between turns")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    setup_logging("warning")
    common = dict(explorers=args.explorers, steps=args.steps, tasks=args.tasks, group_size=args.group_size,
                  prompt=args.prompt, turn=args.turn, observation=args.observation, turns=args.turns)
    batch_bytes = len(encode_batch(batches("multi-turn", **{**common, "explorers": 1, "steps": 1})[0]))
    shapes = {"single-turn": None, "multi-turn": None, "multi-turn, split": batch_bytes // 2}
    best: dict[str, dict] = {}
    with NatsServer() as server:
        for run in range(args.repeat):
            for shape, max_msg_size in shapes.items():  # interleaved: the machine's load hits every shape
                result = asyncio.run(measure(server.url, shape, run=run, max_msg_size=max_msg_size, **common))
                if shape not in best or result["wall_s"] < best[shape]["wall_s"]:
                    best[shape] = result
    single = best["single-turn"]
    for result in best.values():
        result["of_single_turn"] = result["tokens_per_s"] / single["tokens_per_s"]
        result["of_single_turn_cpu"] = result["tokens_per_cpu_s"] / single["tokens_per_cpu_s"]
    out = {"settings": {**common, "repeat": args.repeat, "batch_bytes": batch_bytes},
           "load_average": os.getloadavg(), "shapes": list(best.values())}
    for result in best.values():
        print(f"{result['shape']:>18}: {result['episodes_per_s']:8.0f} episodes/s {result['tokens_per_s']:10.0f} "
              f"tokens/s  {result['cpu_us_per_episode']:6.0f} µs CPU/episode  {result['messages']} messages  "
              f"{result['of_single_turn']:.2f} of single-turn ({result['of_single_turn_cpu']:.2f} by CPU)")
    print(json.dumps(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
