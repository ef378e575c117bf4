"""The `fsdp` engine tests' ranks: `run_ranks` starts them through the product's rank launcher
(`roles.launch.ranks.supervise_ranks`); each is `python -m tests.support.fsdp_ranks SCENARIO WORKDIR`.

Rank, world size and rendezvous come from torchrun's environment variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), set by the launcher. Inputs are in WORKDIR (`experiences.json`, `model/`);
each scenario writes what the test asserts on under WORKDIR/<scenario>/.

- `train`: 3 steps, the stream, a DCP checkpoint, a Hugging Face export and the logits of a probe
  batch; then a 4th step.
- `resume`: load `train`'s checkpoint, then the same 4th step (with gradient checkpointing).
- `lora-train`, `lora-resume`: the same under `model.lora` (checkpoint `lora-ckpt`, export `lora-hf`,
  merged too).
- `dpo-train`: 3 DPO steps on the preference pairs of `pairs.json` (the frozen reference kept as a
  `stage: dpo` keeps it), a checkpoint `dpo-ckpt`, then a 4th; `dpo-resume`: load it, the same 4th;
  `dpo-from-ckpt`: a new stage from `dpo-ckpt`'s weights (`model.init_from`), then the 4th batch.
- `masked`: the multi-turn episodes of `masked.json` (loss masks with an environment's tokens), 2
  steps each by the whole model (`MASKED_ALGORITHM`, with off-policy correction) and by a LoRA
  adapter (`ALGORITHM`).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
from pathlib import Path

import structlog
import torch
from safetensors.torch import save_file

from rolectl.roles.config import parse_config
from rolectl.roles.engines import make_train_engine
from rolectl.roles.engines.dpo import DPOLoss, TokenPair, preference_batch
from rolectl.roles.engines.fsdp import FSDPTrainEngine
from rolectl.roles.engines.losses import TrainBatch
from rolectl.roles.launch.ranks import RankLayout, supervise_ranks
from rolectl.sync_protocol.experience import Experience
from tests.support.tiny_llm import data_section, model_section

ROOT = Path(__file__).resolve().parents[2]
RANK_TIMEOUT_S = 240  # a bound on "hung": a rank still running then prints its stacks and exits
BUCKET_BYTES = 16 << 10
PROBE = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 4, 5, 6]]
FSDP_SETTINGS = {"engine": "fsdp", "group_size": 3, "minibatches": 2, "micro_batch_size": 1}
ALGORITHM = {"kl_coef": 0.05}  # exercises the sharded frozen reference model too
DPO_BETA = 0.5
LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], "merge_on_save": True}
# sequences counted across ranks; the off-policy correction's proximal logprobs gathered across them
MASKED_ALGORITHM = {"kl_coef": 0.05, "loss_agg_mode": "seq-mean-token-mean",
                    "rollout_correction": {"rollout_is": "token"}}


def run_ranks(scenario: str, workdir: Path, world_size: int, *, module: str = "tests.support.fsdp_ranks") -> list[dict]:
    """Run `scenario` of `module` as `world_size` ranks with the trainer's own launcher (one rank
    failing ends them all); their reports, by rank. The ranks' output goes to the test's (captured) output."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    # `env` execs python in its place: the launcher's kill reaches the rank itself
    command = ["env", f"PYTHONPATH={path}", "OMP_NUM_THREADS=1", sys.executable, "-m", module, scenario, str(workdir)]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = supervise_ranks(RankLayout(world_size), command, max_restarts=0,
                               log=structlog.get_logger().bind(scenario=scenario))
    finally:  # the launcher took Ctrl-C and SIGTERM to stop its ranks: give them back to the test
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert code == 0, f"{scenario}: the ranks ended with exit {code} (each rank's output is in the test's)"
    return [json.loads((workdir / scenario / f"report-{rank}.json").read_text()) for rank in range(world_size)]


# fp32 sums in another order (two ranks' shards, micro-batches of 1 against 4) round gradients
# differently, and AdamW divides by sqrt(v): where a gradient is near zero its rounding is not small
# beside it, so single elements may differ by a sizeable part of one lr step (3e-3). What must agree is
# the training itself: each tensor's change, to within RTOL of its length; and no element may stray
# further than ATOL (a tenth of one lr step).
RTOL = 1e-3
ATOL = 3e-4
# Where no element's gradient sits at its rounding (a LoRA adapter's few parameters, one step after a
# resume), the weights agree to about fp32 rounding.
ROUNDING = 2e-5


def assert_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *, atol: float) -> None:
    assert sorted(got) == sorted(expected)
    worst = max((float((got[n] - expected[n]).abs().max()), n) for n in expected)
    assert worst[0] <= atol, f"largest difference {worst[0]:.3g} at {worst[1]}"


def assert_same_training(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                         initial: dict[str, torch.Tensor]) -> None:
    """`got` moved from `initial` as `expected` did: per tensor, the two differ by at most RTOL of the
    change training made (and by at most ATOL anywhere)."""
    assert_close(got, expected, atol=ATOL)
    for name, want in expected.items():
        moved = float((want - initial[name]).norm())
        apart = float((got[name] - want).norm())
        assert apart <= RTOL * moved + 1e-7, f"{name}: {apart:.3g} apart after a change of {moved:.3g}"


def load_batches(workdir: Path, name: str = "experiences.json") -> list[list[Experience]]:
    return [[Experience(**{**e, **{key: tuple(e[key]) for key in ("prompt", "response", "logprobs", "loss_mask")
                                   if e.get(key) is not None}}) for e in batch]
            for batch in json.loads((workdir / name).read_text())]


def load_pair_batches(workdir: Path) -> list[TrainBatch]:
    return [preference_batch([TokenPair(id=p["id"], prompt=tuple(p["prompt"]), chosen=tuple(p["chosen"]),
                                        rejected=tuple(p["rejected"])) for p in batch])
            for batch in json.loads((workdir / "pairs.json").read_text())]


def dpo_step(engine, batch: TrainBatch) -> dict:
    """One DPO train step of a stage (`engine.train_batch`, the one training step with the DPO loss)."""
    return engine.train_batch(batch, DPOLoss(beta=DPO_BETA))


def _dpo(scenario: str, workdir: Path, out: Path) -> None:
    """The `dpo-` scenarios: an fsdp engine that keeps the frozen reference, DPO steps, a checkpoint."""
    from rolectl.roles.engines.algorithms import AlgorithmConfig
    from rolectl.roles.engines.sections import FSDPModelSection

    # from a checkpoint: one minibatch, so the step's figures are all taken before its one update
    start = {"init_from": str(workdir / "dpo-ckpt"), "minibatches": 1} if scenario == "dpo-from-ckpt" else {}
    section = FSDPModelSection.model_validate(model_section(workdir / "model", **{**FSDP_SETTINGS, **start}))
    engine = FSDPTrainEngine(section, AlgorithmConfig(), model_path=workdir / "model", keep_reference=True)
    rank, batches = engine.rank, load_pair_batches(workdir)
    report: dict = {"rank": rank, "world_size": engine.world_size}
    if scenario == "dpo-train":
        report["metrics"] = [dpo_step(engine, batch) for batch in batches[:3]]
        weights = engine.weights()
        if rank == 0:
            save_file(weights, str(out / "weights-3.safetensors"))
        engine.save_checkpoint(workdir / "dpo-ckpt")
    elif scenario == "dpo-resume":
        engine.load_checkpoint(workdir / "dpo-ckpt")
        report["step_after_load"] = engine.step
    else:  # dpo-from-ckpt: a new stage that starts from dpo-train's weights (its own step 0)
        weights = engine.weights()
        if rank == 0:
            save_file(weights, str(out / "weights-start.safetensors"))
    report["metrics_4"] = dpo_step(engine, batches[3])
    weights = engine.weights()
    if rank == 0:
        save_file(weights, str(out / "weights-4.safetensors"))
    (out / f"report-{rank}.json").write_text(json.dumps(report))
    engine.close()


def probe_logits(engine: FSDPTrainEngine) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(input_ids=torch.tensor(PROBE)).logits.float()


def masked(workdir: Path, out: Path) -> None:
    """Both engines in one process group: the LoRA one joins the group the first made."""
    batches = load_batches(workdir, "masked.json")
    report: dict = {}
    engines = []
    for name, settings, algorithm in (("full", FSDP_SETTINGS, MASKED_ALGORITHM),
                                      ("lora", {**FSDP_SETTINGS, "lora": LORA}, ALGORITHM)):
        job = parse_config({"job": "fsdp-test", "model": model_section(workdir / "model", **settings),
                            "data": data_section(), "algorithm": algorithm})
        engine = make_train_engine(job)
        assert isinstance(engine, FSDPTrainEngine)
        engines.append(engine)
        # rank 0 alone holds each batch; the others get it over the process group (masks included)
        report[name] = [engine.train_step(engine.share_batch(batch if engine.rank == 0 else None),
                                          current_version=step) for step, batch in enumerate(batches)]
    report["rank"], report["world_size"] = engines[0].rank, engines[0].world_size
    (out / f"report-{engines[0].rank}.json").write_text(json.dumps(report))
    for engine in reversed(engines):
        engine.close()


def main(scenario: str, workdir: Path) -> None:
    faulthandler.dump_traceback_later(RANK_TIMEOUT_S, exit=True)
    out = workdir / scenario
    out.mkdir(exist_ok=True)
    if scenario == "masked":
        return masked(workdir, out)
    if scenario.startswith("dpo-"):
        _dpo(scenario, workdir, out)
        return
    lora = scenario.startswith("lora-")
    prefix = "lora-" if lora else ""
    # Resuming recomputes activations in backward: the same step, by another path.
    settings = {**FSDP_SETTINGS, "gradient_checkpointing": scenario.endswith("resume"),
                **({"lora": LORA} if lora else {})}
    job = parse_config({"job": "fsdp-test", "model": model_section(workdir / "model", **settings),
                        "data": data_section(), "algorithm": ALGORITHM})
    engine = make_train_engine(job)
    assert isinstance(engine, FSDPTrainEngine)
    rank, batches = engine.rank, load_batches(workdir)
    report: dict = {"rank": rank, "world_size": engine.world_size}
    if scenario.endswith("train"):
        # Rank 0 alone holds each batch, as the rank that reads the bus will; the others receive it.
        report["metrics"] = [engine.train_step(engine.share_batch(batch if rank == 0 else None), current_version=step)
                             for step, batch in enumerate(batches[:3])]
        buckets = list(engine.iter_weight_buckets(BUCKET_BYTES))
        report["buckets"] = [[(name, list(t.shape)) for name, t in bucket] for bucket in buckets]
        if rank == 0:
            save_file({n: t for bucket in buckets for n, t in bucket}, str(out / "weights-3.safetensors"))
        del buckets
        engine.save_checkpoint(workdir / f"{prefix}ckpt", extra={"data_position": 3, "trained": ["a", "b"]})
        engine.save_hf_model(workdir / f"{prefix}hf", bucket_bytes=BUCKET_BYTES)
        logits = probe_logits(engine)
        if rank == 0:
            save_file({"logits": logits}, str(out / "logits.safetensors"))
    else:
        report["extra"] = engine.load_checkpoint(workdir / f"{prefix}ckpt")
        report["step_after_load"] = engine.step
        loaded = engine.weights()  # a collective: every rank gathers
        if rank == 0:
            save_file(loaded, str(out / "weights-3.safetensors"))
    kept = {n: t.clone() for n, t in loaded.items()} if scenario.endswith("resume") else {}
    report["metrics_4"] = engine.train_step(batches[3], current_version=3)
    # What the stream gave is a snapshot: the next step must not change it under its consumer.
    report["snapshot_unchanged"] = all(torch.equal(loaded[n], t) for n, t in kept.items())
    weights = engine.weights()
    if rank == 0:
        save_file(weights, str(out / "weights-4.safetensors"))
    (out / f"report-{rank}.json").write_text(json.dumps(report))
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
