"""An agent application for a served rolectl explorer: reverses digit strings over the OpenAI API.

Each episode is a short multi-turn session (`--attempts` of them side by side per task): it asks
the model to reverse a task from examples/data/reverse_digits.jsonl ("reverse 6 0 4 =" -> "4 0 6");
if the answer is not exact it
asks once more (the conversation so far, then the task again), and it reports the mean of its
answers' scores (the fraction of digits in place) as the session's reward to `POST /v1/rewards`. The served
explorer turns each rewarded session into one trajectory (the answers trained on, the user's messages
between them not), the trainer learns from them, and the explorer serves the newer weights: the
agent's reward rises while it runs.

The multi-turn variant, `--min-turns 2 --turn-rewards`: every session has at least two calls (the
model answers, is asked again with its answer in the conversation, and answers again), and each
answer's score is sent as its turn's reward (`done: false`, the last one `done: true`).

It uses only the official `openai` client. It runs until the endpoint stops serving (the job's
trainer finished: 503, or the server is gone), or for `--episodes`. Run by the explorer from
examples/serve_quickstart.yaml (`serve.agent`), or by hand against any serving explorer:

    OPENAI_BASE_URL=http://127.0.0.1:PORT/v1 OPENAI_API_KEY=none python examples/agent_digits.py --model JOB
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import uuid
from pathlib import Path

import openai

DATA = Path(__file__).resolve().parent / "data" / "reverse_digits.jsonl"


class EndpointClosed(Exception):
    """The endpoint stopped serving: the job is over."""


def score(response: str, answer: str) -> float:
    """The fraction of answer digits the response has in the same place (extra digits cost credit)."""
    got, want = response.split(), answer.split()
    return sum(g == w for g, w in zip(got, want)) / max(len(got), len(want), 1)


async def episode(client: openai.AsyncOpenAI, model: str, task: dict, turns: int, *, min_turns: int = 1,
                  turn_rewards: bool = False) -> tuple[float, int]:
    """One session: ask, ask again (the conversation so far, then the task again) while wrong or
    fewer than `min_turns` calls were made, up to `turns` calls; reward the session.

    The served explorer trains the session as one trajectory: the first prompt, then each answer
    (trained on) and the user's next message (context). Its reward: the mean of the answers' scores,
    or with `turn_rewards` each answer's score sent as that turn's reward (`done: false`) and the
    session's reward their sum (or discounted sum, as the job's `serve.reward` says)."""
    session = uuid.uuid4().hex
    messages = [{"role": "user", "content": task["prompt"]}]
    scores: list[float] = []
    for turn in range(turns):
        reply = await client.chat.completions.create(model=model, messages=messages,
                                                     extra_body={"session_id": session})
        text = reply.choices[0].message.content or ""
        scores.append(score(text, task["answer"]))
        last = turn + 1 == turns or (scores[-1] == 1.0 and turn + 1 >= min_turns)
        if turn_rewards:
            await client.post("/rewards", body={"id": reply.id, "reward": scores[-1], "done": last}, cast_to=object)
        if last:
            break
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": task["prompt"]}]
    # credit for every attempt: a first answer that is partly right is worth more than one that is not
    reward = statistics.fmean(scores)
    if not turn_rewards:
        await client.post("/rewards", body={"session": session, "reward": reward}, cast_to=object)
    return reward, len(scores)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.environ.get("ROLECTL_SERVE_MODEL"),
                        help="the served model id (default: $ROLECTL_SERVE_MODEL, which the explorer sets)")
    parser.add_argument("--data", default=str(DATA), help="tasks, one JSON object per line (prompt, answer)")
    parser.add_argument("--turns", type=int, default=2, help="calls per session at most")
    parser.add_argument("--min-turns", type=int, default=1,
                        help="calls per session at least, right answer or not (the multi-turn variant: 2)")
    parser.add_argument("--turn-rewards", action="store_true",
                        help="send each answer's score as its turn's reward; the session's reward is their sum "
                             "(or discounted sum: serve.reward) instead of their mean")
    parser.add_argument("--attempts", type=int, default=4,
                        help="sessions per task, run side by side (the served explorer groups the turns of "
                             "sessions that began with the same prompt: set it to model.group_size)")
    parser.add_argument("--concurrency", type=int, default=1, help="tasks in flight (each with its attempts)")
    parser.add_argument("--episodes", type=int, default=0, help="stop after this many (0: until the job ends)")
    parser.add_argument("--report-every", type=int, default=200, help="print the mean reward every N episodes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not args.model:
        parser.error("--model (or ROLECTL_SERVE_MODEL) names the served model")
    tasks = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    rng = random.Random(args.seed)
    # 429 (the endpoint's queue is full) is retried with back-off by the client itself
    client = openai.AsyncOpenAI(max_retries=8)
    rewards: list[float] = []
    started = 0
    stop = asyncio.Event()

    async def worker() -> None:
        nonlocal started
        while not stop.is_set() and (not args.episodes or started < args.episodes):
            started += args.attempts
            task = rng.choice(tasks)
            try:
                done = await asyncio.gather(*(episode(client, args.model, task, args.turns,
                                                      min_turns=args.min_turns, turn_rewards=args.turn_rewards)
                                              for _ in range(args.attempts)))
            except openai.APIStatusError as exc:
                if exc.status_code == 503:
                    stop.set()  # the job finished
                    return
                raise
            except openai.APIConnectionError:
                stop.set()  # the endpoint is gone
                return
            before = len(rewards) // args.report_every
            rewards.extend(reward for reward, _ in done)
            if len(rewards) // args.report_every > before:
                recent = rewards[-args.report_every:]
                print(f"episodes {len(rewards)}: mean reward of the last {len(recent)} "
                      f"{statistics.fmean(recent):.3f}", flush=True)

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    await client.close()
    if not rewards:
        print("no episode completed", file=sys.stderr)
        return 1
    window = max(1, min(args.report_every, len(rewards) // 2))
    first, last = statistics.fmean(rewards[:window]), statistics.fmean(rewards[-window:])
    print(json.dumps({"episodes": len(rewards), "reward_first": round(first, 4), "reward_last": round(last, 4),
                      "window": window}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
