"""The `hf` trainer's step on a long-tailed batch, micro-batches by rows against by a token budget
(`model.micro_batch_tokens`, `roles.engines.step.micro_batches`).

    python -m benchmarks.micro_batches [--repeats 5] [--groups 32] [--group-size 8] [--budget 4096]

The batch: `--groups` prompts x `--group-size` responses of random tokens, seeded; prompts 8-16
tokens, responses 4-16 tokens but for `--long-fraction` (10 %) of them, 96-200 (agents' and
reasoning's long tail). The model is the tests' tiny random-init Qwen2 (hidden 64, 2 layers; built
in a temporary directory, nothing downloaded), PPO's loss in 2 minibatches, one torch thread. Each
setting trains the same batch: `rows` (micro-batches of `micro_batch_size` rows in row order, each
padded to its longest), `rows_16`, and `tokens` (`micro_batch_tokens` = `--budget`, rows sorted by
length, `micro_batch_size` 64 still the row cap). Prints each setting's best `train_step` seconds
over `--repeats` after one warm-up, the token positions its forwards ran over (rows x width, summed)
beside the rows' real tokens, its passes and its largest pass (what bounds activation memory), then
one JSON line with them and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rolectl.roles.engines.algorithms import AlgorithmConfig  # noqa: E402
from rolectl.roles.engines.hf import HFTrainEngine  # noqa: E402
from rolectl.roles.engines.hf_model import HFModelConfig, ensure_model  # noqa: E402
from rolectl.sync_protocol.experience import Experience  # noqa: E402

__all__ = ["long_tailed_batch", "main"]

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data" / "reverse_digits.jsonl"
BUILD = {"family": "qwen2", "hidden_size": 64, "num_layers": 2, "num_heads": 2, "head_dim": 32,
         "intermediate_size": 128, "max_position_embeddings": 256, "seed": 0}
SETTINGS = {"rows": {"micro_batch_size": 64}, "rows_16": {"micro_batch_size": 16}, "tokens": {"micro_batch_size": 64}}


def long_tailed_batch(vocab_size: int, *, groups: int, group_size: int, long_fraction: float,
                      seed: int = 0) -> list[Experience]:
    """`groups` x `group_size` experiences of random tokens: most responses short, `long_fraction` long."""
    rng = random.Random(seed)

    def tokens(length: int) -> tuple[int, ...]:
        return tuple(rng.randrange(4, vocab_size) for _ in range(length))

    out = []
    for group in range(groups):
        prompt = tokens(rng.randint(8, 16))
        for k in range(group_size):
            length = rng.randint(96, 200) if rng.random() < long_fraction else rng.randint(4, 16)
            out.append(Experience(id=f"g{group}-{k}", group=f"g{group}", prompt=prompt, response=tokens(length),
                                  logprobs=tuple(-rng.uniform(0.5, 4.0) for _ in range(length)),
                                  reward=rng.random(), model_version=0))
    return out


def _measured(engine: HFTrainEngine, experiences: list[Experience], repeats: int) -> dict[str, float]:
    """Best `train_step` seconds over `repeats` after a warm-up, and the warm-up's forwards: positions
    (rows x width, summed), passes and the largest pass."""
    shapes: list[tuple[int, int]] = []
    hook = engine.model.register_forward_hook(
        lambda _m, _args, kwargs, _out: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    engine.train_step(experiences, current_version=0)  # warm-up
    hook.remove()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        engine.train_step(experiences, current_version=0)
        seconds.append(time.perf_counter() - started)
    return {"train_step_s": round(min(seconds), 4), "positions": sum(rows * width for rows, width in shapes),
            "passes": len(shapes), "largest_pass": max(rows * width for rows, width in shapes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--long-fraction", type=float, default=0.1)
    parser.add_argument("--budget", type=int, default=4096, help="micro_batch_tokens of the `tokens` setting")
    args = parser.parse_args()
    torch.set_num_threads(1)
    figures: dict[str, object] = {"load_before": os.getloadavg()[0], "budget": args.budget}
    with tempfile.TemporaryDirectory() as tmp:
        base = {"path": str(Path(tmp) / "model"), "build": BUILD, "group_size": args.group_size,
                "max_new_tokens": 200, "lr": 1e-4, "minibatches": 2}
        path = ensure_model(HFModelConfig.model_validate(base), data_path=str(DATA))
        experiences = None
        for name, setting in SETTINGS.items():
            budget = args.budget if name == "tokens" else None
            engine = HFTrainEngine(HFModelConfig.model_validate({**base, **setting, "micro_batch_tokens": budget}),
                                   AlgorithmConfig(), model_path=path)
            if experiences is None:
                experiences = long_tailed_batch(engine.vocab_size, groups=args.groups, group_size=args.group_size,
                                                long_fraction=args.long_fraction)
                figures["rows"] = len(experiences)
                figures["real_tokens"] = sum(len(e.prompt) + len(e.response) for e in experiences)
            measured = _measured(engine, experiences, args.repeats)
            print(f"{name:8} train_step {measured['train_step_s']:.3f} s  positions {measured['positions']:,} "
                  f"(real {figures['real_tokens']:,})  passes {measured['passes']}  "
                  f"largest pass {measured['largest_pass']:,}", flush=True)
            figures.update({f"{name}_{key}": value for key, value in measured.items()})
    figures["speedup"] = round(float(figures["rows_train_step_s"]) / float(figures["tokens_train_step_s"]), 2)
    figures["load_after"] = os.getloadavg()[0]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
