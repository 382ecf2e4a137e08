"""The QAT weights shipped with mini (``attnqat/models/mini/attn_qat.safetensors``) recover part of what FP4
attention costs the model, on held-out clips the fine-tune never saw: under FP4 attention their flow loss is
lower than the base weights', and their velocity is closer to the base model's bf16 velocity. The GPU runs and
the full table are in docs/quality.md; this checks the shipped artefact and its loading path at CI cost.

The second test trains: a few distillation steps under Attn-QAT from mini's base weights, on the CPU at a
small size, lower the FP4 student's held-out flow loss and its distance to the bf16 model's velocity. (Measured
while writing it, 24 steps of batch 8 at 9x64x64, lr 2e-5, ~60 s: the distance fell 3-14% and the loss 2-4% over
three seeds; at lr 1e-4 the distance grew 22%, as docs/quality.md's first round found for high rates. The test ran
16 steps until 2026-11-28, when with torch 2.13, diffusers 0.42.1 and transformers 5.24 on the CPU the distance after
16 steps grew on three of four run seeds (+6.0, +3.4, -0.7% on seeds 1-3, +3.5% on the test's own) while the loss
fell 2-4%; after 24 steps it fell on all four (-7.7, -6.7, -8.2, -1.3%) and the loss 2.0-4.5%: 24 steps, ~50 s.)

Skipped where mini's weights or its QAT weights are not installed."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from attnqat.mini.model import MINI_DIR, MINI_QAT_WEIGHTS as QAT_FILE_NAME

QAT_WEIGHTS = MINI_DIR / QAT_FILE_NAME

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MINI_DIR / "model_index.json").is_file() or not QAT_WEIGHTS.is_file(),
                       reason="mini's weights or its QAT weights are not installed"),
]


def test_shipped_qat_weights_recover_part_of_the_fp4_gap_on_held_out_clips():
    from attnqat.mini.evaluation import Variant, _Weights, flow_metrics, held_out_clips
    from attnqat.pipelines import load_pipeline
    from attnqat.pipelines.loading import read_qat_checkpoint, trained_mode_options

    pipe = load_pipeline("mini", dtype=torch.float32, device="cpu")
    # 33x128x128 is a size mini trained at (576 self-attention tokens); the held-out split holds attribute
    # combinations training never showed, and the noise is fixed, so every row sees the same inputs. Two clips: the
    # FP4 attention rows dominate the cost, and each of the first four clips alone shows the recovery with a wide
    # margin (the shipped weights, run with their rotation and Q smoothing, win back 54-79% of the loss gap and sit
    # at 0.32-0.36x FP4's velocity distance; with the rotation alone 0.44-0.49x, and without either 0.65-0.75x,
    # which the bound below refuses)
    data = held_out_clips(pipe, 2, size=(33, 128, 128), batch=2)
    qat = read_qat_checkpoint(pipe.transformer, QAT_WEIGHTS)
    # as a user runs them: with the Q/K options they were trained under (the rotation, Q smoothing), as their file
    # records them
    variants = [Variant("bf16"), Variant("nvfp4", "nvfp4"),
                Variant("qat", "attn_qat", qat, options=trained_mode_options("attn_qat", QAT_WEIGHTS))]
    rows = flow_metrics(pipe.transformer, variants, data["x0"], data["embeds"], batch=2,
                        weights=_Weights(pipe.transformer))
    bf16, fp4, recovered = rows["bf16"], rows["nvfp4"], rows["qat"]
    # FP4 costs the base model loss and moves its prediction ...
    assert fp4["flow_loss"] > bf16["flow_loss"] and fp4["velocity_distance"] > 1e-3, rows
    # ... and the QAT weights, in the same FP4 attention, win part of both back (docs/quality.md: 63% / 64% on
    # 32 clips at this size), without overshooting past bf16
    assert bf16["flow_loss"] < recovered["flow_loss"] < fp4["flow_loss"] - 0.25 * (fp4["flow_loss"] - bf16["flow_loss"])
    assert recovered["velocity_distance"] < 0.5 * fp4["velocity_distance"], rows


TRAINING_TEST = "test_a_few_qat_steps_on_mini_lower_its_fp4_held_out_loss_and_velocity_distance"


@pytest.fixture(scope="module", autouse=True)
def training(request, tmp_path_factory):
    """The training test's run, started in a process forked at the module's start (one thread; as fast here as
    two, ~55 s) so that it trains side by side with the shipped-weights check in this process (the suite has two
    cores); the training test waits for it. Its seed is drawn as that test's own (conftest's test_seed). None
    where the training test is not selected."""
    from conftest import ForkedProcess, test_seed

    item = next((i for i in request.session.items if i.module is request.module and i.name == TRAINING_TEST), None)
    if item is None:
        yield None
        return
    run_seed = int(torch.randint(0, 2 ** 31 - 1, (), generator=torch.Generator().manual_seed(test_seed(item.nodeid))))
    out = tmp_path_factory.mktemp("qat")

    def run():
        from attnqat.train import load_config, train

        cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "mini_qat.yaml", [
            f"model={MINI_DIR}", f"output_dir={out / 'run'}", f"seed={run_seed}",
            "objective.type=distill", "objective.target=output", "train.lr=2e-5", "train.warmup_steps=0",
            "train.max_steps=24", 'train.mixed_precision="no"', "data.batch_size=8", "data.held_out=16",
            "data.corpus.sizes=[[9,64,64]]", "data.corpus.size_weights=null", "data.corpus.pool=32",
            "data.corpus.refresh=4", "data.corpus.refresh_every=1", "log.eval_every=24", "checkpoint.every=24"])
        result = train(cfg)
        (out / "result.json").write_text(json.dumps({"steps": result.steps, "before": result.gap_before,
                                                     "after": result.gap_after}))

    proc = ForkedProcess(run)
    try:
        yield SimpleNamespace(process=proc, result=out / "result.json", seed=run_seed)
    finally:
        proc.close()


def test_a_few_qat_steps_on_mini_lower_its_fp4_held_out_loss_and_velocity_distance(training):
    """attnqat train's loop, as configs/mini_qat.yaml with distillation from the bf16 base: 24 steps at 9x64x64
    (48 tokens) on fresh corpus clips, the run's seed drawn from the test's. The held-out clips are the corpus's
    held-out split (attribute pairs mini never trained on), evaluated before and after by the loop itself. The run
    is the ``training`` fixture's, in its forked process."""
    run = training.process.wait(time.monotonic() + 600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(training.result.read_text())
    before, after = result["before"], result["after"]
    where = (before, after, f"run seed {training.seed}")
    assert result["steps"] == 24 and all(map(math.isfinite, (*before.values(), *after.values()))), where
    # the FP4 student (attn_qat) against the frozen bf16 base on the held-out clips: closer, and a lower loss
    assert after["output"] < before["output"], where
    assert after["flow"] < before["flow"], where
