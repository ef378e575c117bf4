"""The stage tests' ranks: an SFT stage's steps on an `fsdp` trainer of N ranks, driven as the stage runner
drives them: rank 0 through the trainer's `RankLeader` (its `schedule`, `train_batch` and
`evaluate_batch` commands), the others in the launcher's `follow` loop. Started by
`fsdp_ranks.run_ranks(..., module="tests.support.stage_ranks")`; inputs in WORKDIR (`model/`,
`demos.jsonl`), the report and the weights under WORKDIR/<scenario>/.

- `sft`: the schedule, 3 train steps of the stage's plan, an eval batch, the weights.
"""

from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path
from typing import Any

import structlog
from safetensors.torch import save_file

from rolectl.roles.config import parse_config
from rolectl.roles.engines import make_train_engine
from rolectl.roles.launch.ranks import RankLeader, follow
from rolectl.roles.stage import STAGE_DATA, StagePlan, stage_loss
from tests.support.tiny_llm import model_section

RANK_TIMEOUT_S = 240
STEPS = 3
SFT = {"batch_size": 6, "warmup_steps": 1, "lr_schedule": "cosine", "min_lr_ratio": 0.1, "prompt_key": "prompt",
       "response_key": "answer"}
SFT_MODEL = {"minibatches": 2, "micro_batch_size": 1, "lr": 3e-3}


def job(workdir: Path, engine: str, **model: Any):
    """The SFT job both the ranks and the one-process run train."""
    return parse_config({"job": "stage-ranks", "stage": "sft",
                         "model": model_section(workdir / "model", engine=engine, **{**SFT_MODEL, **model}),
                         "sft": {"path": str(workdir / "demos.jsonl"), **SFT}})


def run_steps(engine: Any, cfg: Any) -> dict[str, Any]:
    """What the stage runner does for `STEPS` steps: the plan's rows, the schedule, `train_batch`; then
    the loss of the first batch again as an eval (nothing trained)."""
    data = STAGE_DATA["sft"][0](cfg, engine.tokenizer)
    plan = StagePlan(len(data), batch_size=cfg.sft.batch_size, epochs=cfg.sft.epochs, shuffle_seed=0)
    engine.set_lr_schedule("cosine", warmup_steps=1, total_steps=plan.total_steps * cfg.model.minibatches,
                           min_lr_ratio=0.1)
    metrics = [engine.train_batch(data.batch(plan.rows_of(step)), data.loss) for step in range(STEPS)]
    evaluated = engine.evaluate_batch(data.batch(plan.rows_of(0)), data.loss)
    return {"metrics": metrics, "eval": evaluated}


def main(scenario: str, workdir: Path) -> None:
    faulthandler.dump_traceback_later(RANK_TIMEOUT_S, exit=True)
    out = workdir / scenario
    out.mkdir(exist_ok=True)
    cfg = job(workdir, "fsdp")
    engine = make_train_engine(cfg)
    log = structlog.get_logger().bind(scenario=scenario, rank=engine.rank)
    if engine.rank > 0:
        follow(engine, log, stage_loss=stage_loss(cfg))  # rank 0's commands, until it says stop
        report: dict[str, Any] = {"rank": engine.rank, "step": engine.step}
    else:
        leader = RankLeader(engine)
        report = {"rank": 0, "world_size": engine.world_size, **run_steps(leader, cfg)}
        save_file(leader.weights(), str(out / "weights.safetensors"))
        leader.stop()
    (out / f"report-{engine.rank}.json").write_text(json.dumps(report))
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
