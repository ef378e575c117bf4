"""An SFT stage on the `fsdp` engine on CPU, its 2 ranks real processes started by the trainer's own rank
launcher and driven by rank 0's `RankLeader` as the stage runner drives them, trains as one `hf`
process: the same losses and learning rates step by step, the same eval loss, the same training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rolectl.roles.engines import make_train_engine
from tests.support import fsdp_ranks, stage_ranks
from tests.support.tiny_llm import DATA, built_model


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stage-ranks")
    built_model(root)
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[:15]]  # 3 steps of 6, the last of 3
    (root / "demos.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


@pytest.fixture(scope="module")
def two_ranks(workdir) -> list[dict]:
    return fsdp_ranks.run_ranks("sft", workdir, 2, module="tests.support.stage_ranks")


@pytest.fixture(scope="module")
def hf_run(workdir) -> dict:
    """The same 3 steps by the one-process `hf` engine (micro-batches of 4 rows, not 1 per rank)."""
    engine = make_train_engine(stage_ranks.job(workdir, "hf", micro_batch_size=4))
    initial = engine.weights()
    return {"initial": initial, **stage_ranks.run_steps(engine, stage_ranks.job(workdir, "hf")),
            "weights": engine.weights()}


def test_two_fsdp_ranks_train_an_sft_stage_as_one_hf_process(workdir, two_ranks, hf_run):
    rank0 = two_ranks[0]
    assert rank0["world_size"] == 2 and two_ranks[1]["step"] == stage_ranks.STEPS  # rank 1 made every step
    got, want = rank0["metrics"], hf_run["metrics"]
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want], rel=1e-5)
    assert [m["grad_norm"] for m in got] == pytest.approx([m["grad_norm"] for m in want], rel=1e-4)
    assert [m["lr"] for m in got] == [m["lr"] for m in want] and got[0]["lr"] == 0.0  # warm-up from 0
    assert [m["tokens"] for m in got] == [m["tokens"] for m in want] == [24.0, 24.0, 12.0]  # 3 digits + <eos>
    assert got[2]["loss"] < got[1]["loss"]  # it learns
    assert rank0["eval"]["loss"] == pytest.approx(hf_run["eval"]["loss"], rel=1e-5)
    weights = load_file(workdir / "sft" / "weights.safetensors")
    fsdp_ranks.assert_same_training(weights, hf_run["weights"], hf_run["initial"])
