"""attnqat.train on the tiny model (CPU): the gap falls, resume is exact, validation refuses bad configs,
precompute + flow, the final checkpoint loads, 2 processes (gloo), the FSDP config, bench/train_step.py.

The FP4 attention here runs the PyTorch reference path: TRITON_INTERPRET is turned off (conftest turns it
on for the kernel tests), since the interpreter takes only bf16 and would make each step minutes long.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnqat.train import config_from_dict, load_config, train, validate

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
ENV = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}


@pytest.fixture(autouse=True)
def reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def tiny(tmp_path, *overrides):
    return load_config(TINY, [f"output_dir={tmp_path}", "log.progress=false", *overrides])


def test_short_run_lowers_heldout_gap(tmp_path, capsys):
    """24 steps of feature distillation (configs/tiny.yaml) lower the FP4 student-teacher gap on held-out
    noise, latents, timesteps and embeddings (own seed), in both the output and the block features.

    The run is deterministic (seed 0). On this random-weight model the FP4 error is mostly unstructured
    noise and the fall is small (~2%) and seed-dependent: of seeds 0-4, three fall at these settings and
    four with batch 16 x 48 steps. A loop with a broken gradient (zero, wrong sign, not applied) fails it."""
    r = train(tiny(tmp_path))
    print("gap before", r.gap_before, "after", r.gap_after)
    assert r.gap_before["output"] > 0
    assert r.gap_after["output"] < 0.99 * r.gap_before["output"]
    assert r.gap_after["features"] < 0.99 * r.gap_before["features"]
    rows = list(csv.DictReader((tmp_path / "log.csv").open()))
    assert [int(x["step"]) for x in rows] == list(range(1, 25))
    for key in ("loss", "grad_norm", "lr", "gap", "tokens_per_s"):
        assert float(rows[-1][key]) > 0, key
    assert float(rows[-1]["eval_gap_output"]) == pytest.approx(r.gap_after["output"])
    # elapsed_s: the run's clock, which counts every step (its own step_s included) and never goes back
    elapsed = [float(x["elapsed_s"]) for x in rows]
    assert all(b > a for a, b in zip(elapsed, elapsed[1:]))
    assert elapsed[-1] >= sum(float(x["step_s"]) for x in rows)
    # checkpoints: the last `keep` step folders, no leftovers from the atomic write
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-0000016", "step-0000024"]
    # the final weights load into a fresh tiny transformer and differ from its initial weights
    from attnqat.pipelines import build_tiny_transformer, load_qat_checkpoint
    fresh, init = build_tiny_transformer(), build_tiny_transformer()
    load_qat_checkpoint(fresh, tmp_path / "final")
    changed = [k for k, v in fresh.state_dict().items() if not torch.equal(v, init.state_dict()[k])]
    assert changed and all(".attn1." in k for k in changed)  # train.trainable: attention
    # what the run printed: the held-out change readable at this model's ~1e-5 scale, and a hint that pastes
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("held-out at step 24"))
    now, before = re.search(r"output (\S+) \(from (\S+)\)", line).groups()
    assert float(now) < float(before) and now != before, line
    hint = next(x for x in out.splitlines() if "try it:" in x).split("try it:")[1]
    argv = shlex.split(hint)
    assert argv[:2] == ["attnqat", "generate"]
    from attnqat.cli import build_parser
    args = build_parser("generate").parse_args(argv[1:])
    assert args.qat_checkpoint == str(tmp_path / "final") and args.prompt and args.mode == "attn_qat"


def test_qk_rotation_trains_through_the_rotated_attention(tmp_path, capsys):
    """attention.options.qk_rotation reaches every student processor, changes the FP4 student-teacher gap the run
    starts from (the rotation is in the forward), trains, and the printed hint deploys it the same way."""
    from attnqat.cli import build_parser
    from attnqat.pipelines.processor import AttnQATProcessor

    seen = []
    real = AttnQATProcessor.__init__

    def init(self, mode, **kw):
        real(self, mode, **kw)
        seen.append((mode, dict(self.options)))

    runs = {}
    for rotation in ("none", "hadamard"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(AttnQATProcessor, "__init__", init)
            runs[rotation] = train(tiny(tmp_path / rotation, "train.max_steps=2", "train.warmup_steps=1",
                                        "checkpoint.every=2", f"attention.options.qk_rotation={rotation}"))
        assert seen and all(opts == {"qk_rotation": rotation} for mode, opts in seen if mode == "attn_qat"), seen
        seen.clear()
        hint = next(x for x in capsys.readouterr().out.splitlines() if "try it:" in x).split("try it:")[1]
        args = build_parser("generate").parse_args(shlex.split(hint)[1:])
        # the hint names the rotation it trained under; without one generate's default (auto) reads the checkpoint
        assert args.qk_rotation == {"none": "auto"}.get(rotation, rotation) and args.mode == "attn_qat"
    plain, rotated = runs["none"], runs["hadamard"]
    assert rotated.steps == 2 and all(math.isfinite(x) for x in rotated.losses)
    assert rotated.gap_before["output"] != plain.gap_before["output"]
    with pytest.raises(ValueError, match="'sagebwd' takes options .*; got .'qk_rotation'"):
        validate(tiny(tmp_path / "int8", "attention.mode=sagebwd", "attention.options.qk_rotation=hadamard"))


def test_resume_reproduces_uninterrupted_losses(tmp_path):
    common = ["train.max_steps=6", "checkpoint.every=3", "data.batch_size=2", "data.held_out=0",
              "objective.target=output", "train.trainable=all", "train.lr_schedule=cosine", "train.warmup_steps=2"]
    full = train(tiny(tmp_path / "full", *common))
    first = train(tiny(tmp_path / "cut", *common), stop_after=3)
    assert len(first.losses) == 3 and not (tmp_path / "cut" / "final").exists()
    rest = train(tiny(tmp_path / "cut", *common), resume="auto")
    assert rest.steps == 6 and len(rest.losses) == 3
    assert first.losses + rest.losses == pytest.approx(full.losses, rel=1e-6, abs=0)
    assert len(set(full.losses)) == 6  # the batches really differ from step to step
    rows = list(csv.DictReader((tmp_path / "cut" / "log.csv").open()))
    assert [int(x["step"]) for x in rows] == list(range(1, 7))
    from safetensors.torch import load_file
    a = load_file(str(tmp_path / "full" / "final" / "transformer.safetensors"))
    b = load_file(str(tmp_path / "cut" / "final" / "transformer.safetensors"))
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)


def test_deterministic_trains_under_torchs_deterministic_algorithms_and_gives_the_setting_back(tmp_path, monkeypatch):
    """train.deterministic: every loss of the run is computed with torch's deterministic algorithms on and cuBLAS's
    workspace set, and the caller's setting is back afterwards; the default run has them off. On the CPU both give
    the same losses (its algorithms are deterministic either way)."""
    from attnqat.train import loop

    seen, real = [], loop.Trainer.losses

    def spy(self, *args, **kwargs):
        seen.append((torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(loop.Trainer, "losses", spy)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")  # absent, and absent again after the test
    common = ["train.max_steps=3", "data.batch_size=2", "data.held_out=1", "objective.target=output"]
    on = train(tiny(tmp_path / "on", *common, "train.deterministic=true"))
    assert len(seen) >= 3 and set(seen) == {(True, ":4096:8")}
    assert not torch.are_deterministic_algorithms_enabled()
    seen.clear()
    off = train(tiny(tmp_path / "off", *common))
    assert len(seen) >= 3 and not any(flag for flag, _ in seen)
    assert on.losses == off.losses and len(set(on.losses)) == 3
    # an op torch has no deterministic version of stops the run in one line naming it (torch's own refusal, raised
    # here where a GPU op would raise it)
    refusal = ("index_add_cuda_ does not have a deterministic implementation, but you set "
               "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this operation...")

    def refuse(self, *args, **kwargs):
        raise RuntimeError(refusal)

    monkeypatch.setattr(loop.Trainer, "losses", refuse)
    with pytest.raises(ValueError, match=r"^train\.deterministic: index_add_cuda_ does not have") as e:
        train(tiny(tmp_path / "refused", *common, "train.deterministic=true"))
    assert "\n" not in str(e.value) and not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(RuntimeError, match="index_add_cuda_"):  # without the setting, torch's error is its own
        train(tiny(tmp_path / "plain", *common))


@pytest.mark.parametrize("override, message", [
    ("objective.type=distil", "objective.type 'distil'"),
    ("objective.target=logits", "objective.target 'logits'"),
    ("attention.mode=fp4", "attention.mode 'fp4'"),
    ("attention.mode=nvfp4", "inference-only"),
    ("data.latent_shape=[8, 2, 8, 8]", "latent channels 8"),
    ("data.latent_shape=[16, 2, 7, 8]", "patch size"),
    ("data.path=/nonexistent/data", "/nonexistent/data"),
    ("objective.type=flow", "needs a dataset of video latents"),
    ("train.lr=0", "train.lr"),
    ("train.lrr=1e-5", "unknown config key train.lrr"),
    ("train.max_steps=ten", "train.max_steps must be an integer"),
    ("attention.layers=[0, 5]", "out of range"),
    ("train.optimizer=sgd", "train.optimizer 'sgd' is not one of adamw, adamw8bit"),
    ("train.shard_teacher=true", "train.shard_teacher must be a string, got True"),  # auto, on or off
])
def test_bad_config_is_refused_before_training(tmp_path, override, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message.replace("[", r"\[")):
        cfg = tiny(tmp_path, override)
        validate(cfg)
    assert not (tmp_path / "checkpoints").exists()


def test_cli_prints_config_errors_in_one_line(tmp_path, capsys):
    from attnqat.cli import main
    assert main(["train", "--config", str(TINY), "--output-dir", str(tmp_path), "--set", "objective.type=nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "objective.type 'nope'" in err[0] and "Traceback" not in err[0]
    assert main(["train", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert main(["train", "--config", str(TINY), "--check"]) == 0
    assert "config OK" in capsys.readouterr().out


def test_example_configs_validate():
    from attnqat.pipelines.wan_configs import WAN21_1_3B_TRANSFORMER_CONFIG, WAN21_14B_TRANSFORMER_CONFIG

    for name, tc in (("wan2.1-1.3b", WAN21_1_3B_TRANSFORMER_CONFIG), ("wan2.1-14b", WAN21_14B_TRANSFORMER_CONFIG)):
        cfg = load_config(ROOT / "configs" / f"{name}.yaml", ["data.path=null"])
        assert cfg.train.lr <= 1e-5 and cfg.train.weight_decay == 0.01 and cfg.train.grad_clip == 1.0
        assert cfg.train.mixed_precision == "bf16" and cfg.train.gradient_checkpointing
        assert validate(cfg, transformer_config=tc, device_type="cuda").index["latent_shape"] == [16, 21, 60, 104]
    # the dataclass defaults follow the published recipe
    d = config_from_dict({})
    assert (d.train.lr, d.train.weight_decay, d.train.grad_clip, d.objective.type) == (1e-6, 0.01, 1.0, "distill")


def test_fsdp_config_for_14b():
    """configs/fsdp_wan14b.yaml (and fsdp2_wan14b.yaml) goes through `accelerate launch`'s own parsing into the FSDP environment,
    and its wrap class resolves to diffusers' WanTransformerBlock (the plugin itself needs a GPU)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.dataclasses import get_module_class_from_name
    from accelerate.utils.launch import prepare_multi_gpu_env
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    from attnqat.pipelines import build_tiny_transformer
    args = launch_command_parser().parse_args(["--config_file", str(ROOT / "configs" / "fsdp_wan14b.yaml"),
                                               "-m", "attnqat.train", "--config", "configs/wan2.1-14b.yaml"])
    args = _validate_launch_command(args)[0]
    env = prepare_multi_gpu_env(args)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert env["FSDP_SHARDING_STRATEGY"] == "FULL_SHARD"
    assert env["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP"
    assert env["FSDP_USE_ORIG_PARAMS"] == "true"
    cls = get_module_class_from_name(build_tiny_transformer(), env["FSDP_TRANSFORMER_CLS_TO_WRAP"])
    assert cls is WanTransformerBlock
    # configs/fsdp2_wan14b.yaml: the same units on FSDP2 (what train.optimizer adamw8bit needs under FSDP)
    args = launch_command_parser().parse_args(["--config_file", str(ROOT / "configs" / "fsdp2_wan14b.yaml"),
                                               "-m", "attnqat.train", "--config", "configs/wan2.1-14b-sp.yaml"])
    env = prepare_multi_gpu_env(_validate_launch_command(args)[0])
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16" and env["FSDP_RESHARD_AFTER_FORWARD"] == "true"
    assert get_module_class_from_name(build_tiny_transformer(), env["FSDP_TRANSFORMER_CLS_TO_WRAP"]) is WanTransformerBlock


def test_precompute_replaces_only_its_own_output_and_only_when_complete(tmp_path):
    """A rerun into an earlier output replaces it once the new one is complete: a run that fails half way
    (the second shard's video is corrupt) leaves the earlier files byte for byte, and no temporary folder.
    A folder with anything beside precompute's files is refused; an empty folder is filled."""
    from attnqat.train.precompute import check_arguments, precompute

    (tmp_path / "d.jsonl").write_text("".join(f'{{"prompt": "clip {i}"}}\n' for i in range(3)))
    run = lambda out, **kw: precompute(str(tmp_path / "d.jsonl"), str(out), max_length=8, shard_size=2,  # noqa: E731
                                       log=lambda *a: None, **kw)
    out = tmp_path / "data"
    run(out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["index.json", "shard-00000.safetensors", "shard-00001.safetensors"]

    import imageio.v3 as iio
    import numpy as np
    iio.imwrite(tmp_path / "v0.mp4", (np.random.rand(9, 32, 32, 3) * 255).astype(np.uint8), fps=16)
    (tmp_path / "v1.mp4").write_bytes(b"not a video")
    (tmp_path / "v.jsonl").write_text("".join(f'{{"prompt": "c{i}", "video": "v{min(i // 2, 1)}.mp4"}}\n'
                                              for i in range(3)))
    with pytest.raises(ValueError, match="v1.mp4.*cannot read it as a video"):  # the input's fault, said so
        precompute(str(tmp_path / "v.jsonl"), str(out), videos=True, max_length=8, height=32, width=32, frames=5,
                   shard_size=2, log=lambda *a: None)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []

    index = run(out, batch_size=1)  # a complete rerun replaces it
    assert index["num_samples"] == 3 and json.loads((out / "index.json").read_text()) == index

    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="did not write"):
        run(out)
    args = argparse.Namespace(prompts=str(tmp_path / "d.jsonl"), model="tiny", out=str(out), max_length=8,
                              shard_size=2, batch_size=1, videos=False, height=480, width=832, frames=81, device=None)
    with pytest.raises(ValueError, match="not empty"):
        check_arguments(args)
    assert (out / "notes.txt").read_text() == "mine"

    empty = tmp_path / "empty"
    empty.mkdir()
    assert run(empty)["num_samples"] == 3 and (empty / "index.json").is_file()


def test_precompute_reads_a_model_folder(tmp_path):
    """`attnqat precompute --model mini` (the name, and the folder as a path): a folder's tokenizer has a
    tokenizer_config.json and no config.json (Wan's hub folders, mini's), and its prompt embeddings are what
    diffusers' WanPipeline.encode_prompt gives for the same prompts, to bf16's rounding, zero past each prompt."""
    from safetensors.torch import load_file

    from attnqat.cli import main
    from attnqat.mini.model import MINI_DIR
    from attnqat.pipelines import load_pipeline

    if not (MINI_DIR / "model_index.json").is_file():
        pytest.skip("mini's weights are not installed")
    prompts = ["a red ball slides left over a striped background", "a blue cube"]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    for name, model in (("name", "mini"), ("path", str(MINI_DIR))):
        out = tmp_path / name
        assert main(["precompute", "--prompts", str(tmp_path / "p.txt"), "--model", model, "--out", str(out),
                     "--device", "cpu"]) == 0
        embeds = load_file(str(out / "shard-00000.safetensors"))["prompt_embeds"]
        pipe = load_pipeline("mini", dtype=torch.float32, device="cpu")
        expected, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=512,
                                         device="cpu", dtype=torch.float32)
        assert embeds.shape == expected.shape == (2, 512, 128)
        expected = expected.detach()
        torch.testing.assert_close(embeds.float(), expected, rtol=2 ** -8, atol=0)  # bf16's rounding, no more
        assert torch.equal(embeds.float().abs().sum(-1) == 0, expected.abs().sum(-1) == 0)  # zero past each prompt


def test_random_wan_folder_is_a_model_folder_the_commands_take(tmp_path, capsys):
    """bench/random_wan_folder.py (the random-weight Wan folder the GPU runs of `attnqat train` use): the
    published 1.3B config cut to one block, a one-layer text encoder of its text_dim, Wan's VAE; the folder passes
    the model-folder checks and loads, its transformer is that config, and a second --out into it is refused. The
    one-GPU LoRA config (configs/wan2.1-14b-lora.yaml, its adamw8bit included) trains on it and writes its LoRA
    file."""
    from conftest import load_script

    from attnqat.pipelines.loading import check_model, load_pipeline
    from attnqat.pipelines.wan_configs import WAN21_1_3B_TRANSFORMER_CONFIG

    bench = load_script(ROOT / "bench" / "random_wan_folder.py", "bench_random_wan_folder")
    out = tmp_path / "wan"
    assert bench.main(["--size", "1.3b", "--layers", "1", "--out", str(out)]) == 0
    assert "RANDOM weights" in capsys.readouterr().out
    check_model(str(out))
    pipe = load_pipeline(str(out), dtype=torch.float32, device="cpu")
    config = dict(pipe.transformer.config)
    listed = lambda v: list(v) if isinstance(v, (tuple, list)) else v  # noqa: E731 - JSON gives lists
    assert {k: listed(config[k]) for k in WAN21_1_3B_TRANSFORMER_CONFIG} == {
        **{k: listed(v) for k, v in WAN21_1_3B_TRANSFORMER_CONFIG.items()}, "num_layers": 1}
    assert pipe.text_encoder.config.d_model == config["text_dim"] == 4096
    assert pipe.transformer.blocks[0].attn1.to_q.weight.dtype == torch.float32  # loaded as asked
    with pytest.raises(SystemExit):
        bench.main(["--size", "1.3b", "--layers", "1", "--out", str(out)])
    # configs/wan2.1-14b-lora.yaml (LoRA-QAT on one GPU) trains on it: fp32 on a CPU, a small latent, two steps
    from attnqat.cli import main
    from attnqat.train.loop import read_log

    (tmp_path / "p.txt").write_text("a red ball\na blue cube\n")
    assert main(["precompute", "--prompts", str(tmp_path / "p.txt"), "--model", str(out), "--out",
                 str(tmp_path / "data"), "--device", "cpu"]) == 0
    sets = [f"model={out}", f"data.path={tmp_path / 'data'}", f"output_dir={tmp_path / 'run'}", "train.max_steps=2",
            "train.warmup_steps=1", "data.latent_shape=[16,2,8,8]", "data.held_out=1", "train.mixed_precision=no", "log.progress=false"]
    assert main(["train", "--config", str(ROOT / "configs" / "wan2.1-14b-lora.yaml"),
                 *[a for kv in sets for a in ("--set", kv)]]) == 0
    rows = read_log(tmp_path / "run" / "log.csv")
    assert [r["step"] for r in rows] == ["1", "2"] and all(math.isfinite(float(r["loss"])) for r in rows)
    assert (tmp_path / "run" / "final" / "pytorch_lora_weights.safetensors").is_file()


def test_gpu_wan14b_train_script_runs_its_resume_check_on_the_cpu(tmp_path):
    """bench/gpu_wan14b_train.sh, what the 14B's GPU sessions run, end to end on the CPU (one process, the 1.3B
    config cut to one block, its header's dry run): the folder, the embeddings, an uninterrupted run, and a run
    killed after its checkpoint and resumed, whose losses equal the uninterrupted run's; each run says its setup
    times and the host's peak memory."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "SIZE": "1.3b", "LAYERS": "1",
           "NPROC": "1", "LATENT": "16,2,8,8", "WAN": str(tmp_path / "wan"), "WAN_DATA": str(tmp_path / "data"),
           "W": str(tmp_path / "w"), "SET": "train.mixed_precision=no log.progress=false", "KILL_AFTER": "0"}
    out = []
    for stage in (["folder"], ["data"], ["through", "3"], ["kill", "3", "2"]):
        run = subprocess.run(["bash", str(ROOT / "bench" / "gpu_wan14b_train.sh"), *stage], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, (stage, run.stdout[-2000:], run.stderr[-2000:])
        out.append(run.stdout)
    through, kill = out[2], out[3]
    assert "host memory used at the peak" in through and len(through.strip().splitlines()) == 4  # + steps 1-3
    assert "checkpoint" in kill and "written in" in kill and "killed pid" in kill and "resumed to step 3" in kill
    assert "set up in model" in kill and "(sha256 verified) in" in kill
    assert kill.strip().endswith("losses equal at every step"), kill[-1000:]


def test_precompute_reports_an_encoder_failure_as_such(tmp_path, monkeypatch, capsys):
    """A RuntimeError of the encoders (out of memory, say) while the output folder is being written is a
    failed computation (exit 1, one line naming the shard), not "could not write folder"; nothing is left."""
    from attnqat.cli import main
    from attnqat.train import precompute as pre

    (tmp_path / "d.jsonl").write_text("".join(f'{{"prompt": "clip {i}"}}\n' for i in range(3)))
    real, calls = pre.encode_prompts, []

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) > 1:  # the second shard
            raise RuntimeError("CUDA out of memory.\nTried to allocate 2 GiB")
        return real(*a, **kw)

    monkeypatch.setattr(pre, "encode_prompts", flaky)
    rc = main(["precompute", "--prompts", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "data"),
               "--max-length", "8", "--shard-size", "2", "--batch-size", "2", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert "failed: encoding shard-00001.safetensors failed (CUDA out of memory. Tried" in err[0]
    assert "could not write" not in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]


def test_precompute_then_flow_and_mix(tmp_path):
    import imageio.v3 as iio
    import numpy as np
    from attnqat.train.precompute import precompute
    for i in range(3):
        iio.imwrite(tmp_path / f"v{i}.mp4", (np.random.rand(18, 32, 48, 3) * 255).astype(np.uint8), fps=16)
    lines = [f'{{"prompt": "clip {i}", "video": "v{i}.mp4"}}' for i in range(3)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    index = precompute(str(tmp_path / "d.jsonl"), str(tmp_path / "data"), videos=True, max_length=8, height=32,
                       width=48, frames=5, shard_size=2, log=lambda *a: None)
    assert index["num_samples"] == 3 and len(index["shards"]) == 2
    assert index["latent_shape"] == [16, 2, 4, 6] and index["text_dim"] == 32
    data = f"data.path={tmp_path / 'data'}"
    for obj in ("flow", "mix"):
        r = train(tiny(tmp_path / obj, data, f"objective.type={obj}", "train.max_steps=2", "data.batch_size=2",
                       "data.held_out=2", "checkpoint.every=100"))
        assert len(r.losses) == 2 and all(np.isfinite(r.losses)) and r.gap_after is not None
    # text-only prompts: distillation on precomputed embeddings; flow refuses them by name
    (tmp_path / "p.txt").write_text("# comment\na red fox\n\nsnow\n")
    precompute(str(tmp_path / "p.txt"), str(tmp_path / "text"), max_length=8, log=lambda *a: None)
    cfg = tiny(tmp_path / "t", f"data.path={tmp_path / 'text'}", "train.max_steps=1", "data.held_out=0")
    assert len(train(cfg).losses) == 1
    with pytest.raises(ValueError, match="prompt embeddings only"):
        validate(tiny(tmp_path / "t", f"data.path={tmp_path / 'text'}", "objective.type=flow"))
    with pytest.raises(ValueError, match="4k\\+1"):
        precompute(str(tmp_path / "d.jsonl"), str(tmp_path / "x"), videos=True, frames=6, height=32, width=48)


def _cli_rank(rank: int, runs: list, out_dir: str):
    """Rank ``rank % 2`` of run ``rank // 2`` of ``runs`` ((port, argv) each): ``attnqat train ARGV`` as torchrun
    starts it, in a process forked from this one; its exit status and output go to OUT_DIR/rank<rank>.json."""
    import contextlib
    import io
    import traceback

    from attnqat.cli import main
    from conftest import as_torchrun_rank

    port, argv = runs[rank // 2]
    as_torchrun_rank(rank % 2, 2, port)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(["train", *argv])
        except SystemExit as e:
            status = e.code
        except BaseException:  # noqa: BLE001 - reported to the parent
            status = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"status": status, "output": out.getvalue() + err.getvalue()}))


@pytest.mark.slow
def test_two_processes_gloo(tmp_path):
    """2 processes (accelerate's MULTI_CPU DDP over gloo) run, stop, then resume, from the CLI; the resume under
    torchrun itself. (`accelerate launch --cpu --num_processes 2` starts one process on accelerate 1.15: use
    torchrun on CPU.) The uninterrupted run and the stopped one run side by side in 4 processes forked from this
    one (torchrun's processes would import torch and diffusers for most of the test's time, 57 s on a shared
    2-core CPU before)."""
    from conftest import free_port, run_forked

    def argv(out):
        return ["--config", str(TINY), "--output-dir", str(out), "--set", "log.progress=false", "--set",
                "data.held_out=2", "--set", "data.batch_size=2", "--max-steps", "4", "--set", "checkpoint.every=2"]

    cut = tmp_path / "cut"
    runs = [(free_port(), argv(tmp_path / "whole")), (free_port(), argv(cut) + ["--stop-after", "2"])]
    run_forked(_cli_rank, (runs, str(tmp_path)), 4, "the uninterrupted and the stopped 2-process runs")
    for rank in range(4):
        done = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert done["status"] == 0, (rank, done["status"], done["output"][-2000:])
        if rank % 2 == 0:  # the main process of each run prints
            assert "2 process(es) on cpu (MULTI_CPU)" in done["output"], done["output"][-2000:]
    state = cut / "checkpoints" / "step-0000002" / "state"
    assert (state / "rng-0.safetensors").exists() and (state / "rng-1.safetensors").exists()  # one per process
    assert not [f for f in state.parent.rglob("*") if f.suffix in (".pkl", ".bin", ".pt")]  # no pickle anywhere
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",  # a free port
               "-m", "attnqat.train", *argv(cut), "--resume", "auto"]
    p = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "resumed from" in p.stdout + p.stderr and "2 process(es) on cpu (MULTI_CPU)" in p.stdout + p.stderr
    assert (cut / "final" / "transformer.safetensors").exists()
    # the resumed run (model and optimizer broadcast from process 0) repeats the uninterrupted one exactly
    from attnqat.train.loop import read_log
    resumed, ref = read_log(cut / "log.csv"), read_log(tmp_path / "whole" / "log.csv")
    assert [r["step"] for r in resumed] == ["1", "2", "3", "4"]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in ref]


def test_generate_loads_final_checkpoint(tmp_path, monkeypatch, capsys):
    """`attnqat generate --qat-checkpoint` on a run's final/ (in this process, on the PyTorch reference attention as
    ENV's processes; tests/test_generate_cli.py runs the command in a real process)."""
    from attnqat.cli import main

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    r = train(tiny(tmp_path, "train.max_steps=1", "data.held_out=0", "data.batch_size=1"))
    out = tmp_path / "v.mp4"
    capsys.readouterr()
    assert main(["generate", "--prompt", "x", "--model", "tiny", "--mode", "attn_qat", "--qat-checkpoint",
                 r.final_checkpoint, "--steps", "1", "--height", "32", "--width", "32", "--frames", "5",
                 "--out", str(out)]) == 0
    assert f"weights      QAT checkpoint {r.final_checkpoint}" in capsys.readouterr().err
    assert out.exists() and out.stat().st_size > 0


def test_bench_train_step_tiny(monkeypatch, capsys):
    """bench/train_step.py --tiny, its main in this process (a subprocess would spend most of the test importing),
    on the PyTorch reference attention as ENV's processes: a row per student mode, the docs left alone."""
    from conftest import load_script

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    bench = load_script(ROOT / "bench" / "train_step.py", "bench_train_step")
    docs = (ROOT / "docs" / "benchmarks.md").read_bytes()
    assert bench.main(["--tiny"]) == 0
    out = capsys.readouterr().out
    assert "| `attn_qat` |" in out and "| `bf16` |" in out
    assert (ROOT / "docs" / "benchmarks.md").read_bytes() == docs


# --- Non-finite training stops, and writes nothing non-finite ------------------------------------------------------

NF = ["train.max_steps=4", "checkpoint.every=2", "data.batch_size=2", "data.held_out=0", "objective.target=output",
      "train.trainable=all"]


def _break_at(monkeypatch, step: int, how: str):
    """Make optimizer step ``step`` (1-based) non-finite: its loss, one gradient, the learning rate, or (after a
    finite step) the weights themselves."""
    from accelerate import Accelerator

    from attnqat.train import loop
    calls = {"n": 0}
    if how == "loss":
        real = loop.Trainer.losses

        def losses(self, batch, *, grad=True):
            out = real(self, batch, grad=grad)
            if grad:
                calls["n"] += 1
                if calls["n"] == step:
                    out["loss"] = out["loss"] * float("nan")
            return out
        monkeypatch.setattr(loop.Trainer, "losses", losses)
    elif how == "grad":
        real = Accelerator.backward

        def backward(self, loss, **kw):
            real(self, loss, **kw)
            calls["n"] += 1
            if calls["n"] == step:
                p = next(p for p in self._models[0].parameters() if p.grad is not None)
                p.grad.view(-1)[0] = float("inf")
        monkeypatch.setattr(Accelerator, "backward", backward)
    elif how == "lr":
        real = loop.lr_lambda
        monkeypatch.setattr(loop, "lr_lambda", lambda cfg: (lambda s: float("inf") if s == step - 1 else real(cfg)(s)))
    elif how == "weights":
        real = torch.optim.AdamW.step

        def opt_step(self, *a, **kw):
            out = real(self, *a, **kw)
            calls["n"] += 1
            if calls["n"] == step:
                self.param_groups[0]["params"][0].data.view(-1)[0] = float("nan")
            return out
        monkeypatch.setattr(torch.optim.AdamW, "step", opt_step)


@pytest.fixture(scope="module")
def nf_full(tmp_path_factory):
    """The uninterrupted NF run's losses (training is seeded by its config: the same in every test)."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("TRITON_INTERPRET", "0")  # as reference_path does for each test
        return train(tiny(tmp_path_factory.mktemp("nf_full"), *NF)).losses


@pytest.mark.parametrize("how", ["loss", "grad", "lr", "weights"])
def test_non_finite_training_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, how, nf_full):
    """A NaN loss or gradient must not be trained on nor exported as final/: the step stops before the optimizer
    updates anything (or, for weights that turned NaN, the checkpoint refuses to write them); no final/, the last
    good checkpoint is intact, and --resume auto continues from it as if nothing had happened."""
    from attnqat.train import checkpoint as ck
    from attnqat.train.checkpoint import NonFiniteTrainingError
    from attnqat.train.loop import read_log
    from safetensors.torch import load_file
    with monkeypatch.context() as m:
        _break_at(m, 3 if how != "weights" else 4, how)
        what = {"loss": "non-finite loss nan", "grad": "grad_norm inf", "lr": "lr inf", "weights": "weight"}[how]
        with pytest.raises(NonFiniteTrainingError, match=what):
            train(tiny(tmp_path, *NF))
    assert not (tmp_path / "final").exists() and not list(tmp_path.rglob("*.tmp"))
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-0000002"]
    ck.verify(tmp_path / "checkpoints" / "step-0000002")
    assert all(torch.isfinite(t).all() for t in load_file(tmp_path / "checkpoints" / "step-0000002" / "state" /
                                                           "model.safetensors").values())
    rows = read_log(tmp_path / "log.csv")
    if how != "weights":
        assert rows[-1]["step"] == "3" and not math.isfinite(float(rows[-1][{"loss": "loss", "grad": "grad_norm",
                                                                            "lr": "lr"}[how]]))
    if how == "lr":  # the checkpoint holds the scheduler's next lr faithfully: resuming stops at the same step
        with pytest.raises(NonFiniteTrainingError, match="step 3: non-finite lr inf"):
            train(tiny(tmp_path, *NF), resume="auto")
        return
    rest = train(tiny(tmp_path, *NF), resume="auto")  # the bad step is redone, now finite
    assert rest.losses == nf_full[2:]


def test_cli_reports_non_finite_training_in_one_line(tmp_path, monkeypatch, capsys):
    from attnqat.cli import main
    _break_at(monkeypatch, 2, "loss")
    assert main(["train", "--config", str(TINY), "--output-dir", str(tmp_path), "--set", "log.progress=false",
                 *[a for o in NF for a in ("--set", o)]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step 2: non-finite loss nan" in err[0] and "last good checkpoint is none" in err[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_teacher_cast_copy_equals_deepcopy_then_cast(dtype):
    """student_teacher.cast_copy: the same module as copy.deepcopy(m).to(dtype), every parameter and buffer bit for
    bit, in dtype, with the same requires_grad; independent of the original (a new tensor per parameter, and
    a parameter shared by two modules stays shared in the copy)."""
    import copy

    from attnqat.pipelines import build_tiny_transformer
    from attnqat.train.student_teacher import cast_copy

    m = build_tiny_transformer().float()
    m.proj_out.weight.requires_grad_(False)
    m.extra, m.other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    m.other.weight = m.extra.weight  # a parameter shared by two modules
    m.twin = m.extra  # a module reached twice
    want = copy.deepcopy(m).to(dtype)
    got = cast_copy(m, dtype)
    a, b = dict(got.named_parameters()), dict(want.named_parameters())
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == dtype and torch.equal(a[k], b[k]) and a[k].requires_grad == b[k].requires_grad
        assert a[k].data_ptr() != dict(m.named_parameters())[k].data_ptr()
    bufs_a, bufs_b = dict(got.named_buffers()), dict(want.named_buffers())
    assert bufs_a.keys() == bufs_b.keys() and all(torch.equal(bufs_a[k], bufs_b[k]) for k in bufs_a)
    assert got.twin is got.extra and got.extra is not m.extra and got.other.weight is got.extra.weight
    with torch.no_grad():
        got.proj_out.weight.add_(1.0)
    assert not torch.equal(m.proj_out.weight.to(dtype), got.proj_out.weight)


def test_a_config_checked_for_another_run_is_refused(tmp_path):
    """train() takes validate()'s checked config as it is, for the device type and process count it was checked
    for; another accelerator is refused in one line before a model is built."""
    from attnqat.train import Trainer

    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"output_dir={tmp_path / 'run'}", "log.progress=false"])
    checked = validate(cfg, device_type="cpu", world_size=2)
    cfg.train.max_steps = 0  # the checked config is a copy: a later change to the caller's does not reach it
    assert checked.config.train.max_steps > 0 and checked.world_size == 2
    with pytest.raises(ValueError, match=r"checked for 2 process\(es\) on cpu, but the run has 1 on cpu"):
        Trainer(checked)


@pytest.mark.gpu
def test_a_bf16_folder_loads_onto_the_gpu_cast_there():
    """On a GPU the cast happens there: the same values as the CPU's fp32 load, every tensor fp32 on the GPU."""
    from attnqat.pipelines.loading import load_transformer, load_transformer_cast_on

    got = load_transformer_cast_on("mini", torch.float32, "cuda").state_dict()
    want = load_transformer("mini", dtype=torch.float32).state_dict()
    assert all(got[k].is_cuda and got[k].dtype == torch.float32 and torch.equal(got[k].cpu(), want[k]) for k in want)


def test_a_bf16_folder_loads_for_training_cast_where_it_runs(tmp_path):
    """loading.load_transformer_cast_on (the loop's student load): from a folder stored in bf16 (mini, like Wan's
    hub folders) it loads as stored and casts on the device, with exactly load_transformer(fp32)'s values; a folder
    stored in fp32, a mixed one and the tiny model load as before. stored_dtype reads only the headers."""
    from safetensors.torch import load_file, save_file

    from attnqat.pipelines.loading import load_transformer, load_transformer_cast_on, stored_dtype

    assert stored_dtype("mini") == torch.bfloat16 and stored_dtype("tiny") is None
    assert stored_dtype(str(tmp_path / "absent")) is None and stored_dtype("Wan-AI/Wan2.1-T2V-1.3B-Diffusers") is None
    got = load_transformer_cast_on("mini", torch.float32, "cpu").state_dict()
    want = load_transformer("mini", dtype=torch.float32).state_dict()
    assert got.keys() == want.keys()
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], want[k]) for k in want)
    # a copy of mini whose transformer is stored in fp32, then one with a tensor in each dtype
    from attnqat.mini.model import mini_folder

    folder = tmp_path / "m"
    shutil.copytree(mini_folder(), folder)
    files = sorted((folder / "transformer").glob("*.safetensors"))
    for f in files:
        save_file({k: v.float() for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    assert stored_dtype(str(folder)) == torch.float32
    got = load_transformer_cast_on(str(folder), torch.float32, "cpu").state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    first = load_file(str(files[0]))
    name = next(iter(first))
    save_file({**first, name: first[name].bfloat16()}, str(files[0]), metadata={"format": "pt"})
    assert stored_dtype(str(folder)) is None
