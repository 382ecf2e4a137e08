"""Training from the procedural corpus (data.source: corpus), from scratch, with EMA weights; the mini
model's folder writer; the held-out evaluation helpers. CPU, small sizes."""
from __future__ import annotations

import json
import re

import pytest
import torch

from attnqat.train.corpus_source import pool_clips, uses_before

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: these small ops run faster on one thread here

SMALL = ["data.corpus.sizes=[[5,32,32],[9,32,64]]", "data.corpus.size_weights=[2,1]", "data.batch_size=2",
         "data.corpus.pool=4", "data.corpus.refresh=2", "data.corpus.refresh_every=1", "data.corpus.encode_batch=3", "data.held_out=2",
         "train.max_steps=6", "train.warmup_steps=2", "checkpoint.every=3", "log.every=1", 'train.mixed_precision="no"',
         "log.progress=false"]


def test_pool_formula_matches_replaying_the_refreshes():
    for pool, refresh in ((4, 1), (5, 2), (6, 6), (7, 3)):
        slots = list(range(pool))  # clips held by each slot; refresh t puts clip pool + t into slot t % pool
        t = 0
        for use in range(12):
            for _ in range(refresh):
                slots[t % pool] = pool + t
                t += 1
            assert pool_clips(pool, refresh, use) == slots, (pool, refresh, use)


def test_pool_refreshed_every_kth_use_holds_the_replayed_clips(mini_folder, tmp_path):
    """refresh_every K: the pool of a size takes refresh * K new clips at every K-th use of that size (uses
    counted per size, sizes cycling 0, 0, 1), in slot order, and each slot's latents are its clip's."""
    from attnqat.train.loop import Trainer

    k, refresh, pool = 2, 1, 4
    trainer = Trainer(_cfg(mini_folder, tmp_path, "train.from_scratch=true", f"data.corpus.refresh_every={k}",
                           f"data.corpus.refresh={refresh}", f"data.corpus.pool={pool}"))
    src = trainer.corpus
    slots = {0: list(range(pool)), 1: list(range(pool))}
    fresh, uses = {0: pool, 1: pool}, {0: 0, 1: 0}
    for step in range(14):
        size = src.size_of_step(step)
        if uses[size] % k == 0:  # the replay: refresh * k clips, the next slots in turn
            for _ in range(refresh * k):
                slots[size][(fresh[size] - pool) % pool] = fresh[size]
                fresh[size] += 1
        uses[size] += 1
        got = src._pool(size, step)
        assert got["clips"] == slots[size], (step, size)
    for size in (0, 1):
        got = src._pools[size]
        for j in (0, pool - 1):
            want, _ = src.encode_clips("train", [src.clip_number(size, got["clips"][j])], size)
            torch.testing.assert_close(got["x0"][j], want[0], rtol=1e-5, atol=1e-5)


def test_size_cycle_counts():
    pattern = [0, 0, 1]
    for step in range(20):
        assert uses_before(pattern, 0, step) == sum(1 for s in range(step) if pattern[s % 3] == 0)
        assert uses_before(pattern, 1, step) == sum(1 for s in range(step) if pattern[s % 3] == 1)


@pytest.fixture(scope="module")
def mini_folder(tmp_path_factory):
    from attnqat.mini.model import build_mini_pipeline, save_pipeline_folder

    return save_pipeline_folder(build_mini_pipeline(), tmp_path_factory.mktemp("m") / "model",
                                vae_dtype=torch.float32, check_size=False)


def _cfg(folder, out, *extra):
    from attnqat.train.mini import transformer_config

    cfg = transformer_config(out, [*SMALL, *extra])
    cfg.model = str(folder)
    return cfg


def test_prompt_embeddings_equal_the_pipelines(mini_folder):
    from diffusers import WanPipeline

    from attnqat.train.config import CorpusConfig
    from attnqat.train.corpus_source import CorpusSource

    src = CorpusSource(str(mini_folder), CorpusConfig(sizes=[[5, 32, 32]], pool=0), text_len=512, device="cpu")
    pipe = WanPipeline.from_pretrained(str(mini_folder), torch_dtype=torch.float32)
    captions = ["a red ball slides left over a striped background", ""]
    want, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, max_sequence_length=512, device="cpu")
    got = src.embed(captions)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # summation order only
    assert torch.equal(got == 0, want == 0)  # the same zero padding past each prompt


def test_own_vae_encodes_channels_last_as_the_pipelines_vae_encodes(mini_folder):
    """A source's own VAE is laid out for encoding (channels-last convolutions: set_up_for_encoding) and gives the
    latents the pipeline's VAE, as loaded, gives the same clips through WanPipeline's normalisation, to float
    rounding; a source built on a pipeline's components leaves that pipeline's VAE as it was."""
    from diffusers import WanPipeline

    from attnqat.train.config import CorpusConfig
    from attnqat.train.corpus_source import CorpusSource

    cfg = CorpusConfig(sizes=[[5, 32, 32]], pool=0)
    src = CorpusSource(str(mini_folder), cfg, text_len=16, device="cpu")
    convs = [m for m in src.vae.modules() if isinstance(m, torch.nn.Conv3d)]
    assert src.channels_last and all(m.weight.is_contiguous(memory_format=torch.channels_last_3d) for m in convs)
    pipe = WanPipeline.from_pretrained(str(mini_folder), torch_dtype=torch.float32)
    corpus = src.corpora["train"]
    video = corpus.render([corpus.spec(j) for j in range(2)], frames=5, height=32, width=32, device="cpu")
    z = pipe.vae.encode(video).latent_dist.mode()
    c = pipe.vae.config
    want = (z - torch.tensor(c.latents_mean).view(1, -1, 1, 1, 1)) / torch.tensor(c.latents_std).view(1, -1, 1, 1, 1)
    got = src.encode_video(video)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # convolution algorithms' summation order only
    borrowed = CorpusSource.from_components(pipe.tokenizer, pipe.text_encoder, pipe.vae, cfg, text_len=16,
                                            device="cpu")
    assert not borrowed.channels_last
    assert all(m.weight.is_contiguous() and m.weight.dtype == torch.float32
               for m in pipe.vae.modules() if isinstance(m, torch.nn.Conv3d))
    torch.testing.assert_close(borrowed.encode_video(video), want, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_own_vae_encodes_in_bf16_channels_last_close_to_the_pipelines(mini_folder):
    """On a GPU the source's own VAE holds bf16, channels-last weights; its latents stay within the bf16 autocast's
    rounding of the float32 NCDHW encode the pipeline's VAE gives under the same autocast."""
    from diffusers import AutoencoderKLWan

    from attnqat.train.config import CorpusConfig
    from attnqat.train.corpus_source import CorpusSource

    src = CorpusSource(str(mini_folder), CorpusConfig(sizes=[[17, 64, 64]], pool=0), text_len=16, device="cuda")
    conv = next(m for m in src.vae.modules() if isinstance(m, torch.nn.Conv3d))
    assert conv.weight.dtype == torch.bfloat16 and conv.weight.is_contiguous(memory_format=torch.channels_last_3d)
    corpus = src.corpora["train"]
    video = corpus.render([corpus.spec(j) for j in range(4)], frames=17, height=64, width=64, device="cuda")
    plain = AutoencoderKLWan.from_pretrained(str(mini_folder), subfolder="vae", torch_dtype=torch.float32).cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        z = plain.encode(video.float()).latent_dist.mode().float()
    want = (z - src.mean) / src.std
    got = src.encode_video(video)
    assert torch.isfinite(got).all()
    assert ((got - want).pow(2).mean() / want.pow(2).mean()).sqrt() < 2e-2


def test_prefetched_pool_refreshes_equal_the_inline_ones(mini_folder):
    """The pool's next refresh encoded ahead on a worker thread (what a GPU run does) gives the very batches the
    inline refresh gives, at every step of two sizes, through several refreshes; a jump in steps (a resumed run)
    drops the stale prefetch and rebuilds the pool as it was."""
    from attnqat.train.config import CorpusConfig
    from attnqat.train.corpus_source import CorpusSource

    cfg = CorpusConfig(sizes=[[5, 32, 32], [1, 32, 32]], size_weights=[2, 1], pool=6, refresh=2, refresh_every=2,
                       encode_batch=4)
    inline = CorpusSource(str(mini_folder), cfg, text_len=16, device="cpu", prefetch=False)
    ahead = CorpusSource(str(mini_folder), cfg, text_len=16, device="cpu", prefetch=True)
    assert ahead.prefetch and not inline.prefetch
    for step in [*range(14), 30, 31, 32]:
        draws = [torch.Generator().manual_seed(step) for _ in range(2)]
        a, b = (src.batch(step, 0, 4, g, 0) for src, g in zip((inline, ahead), draws))
        assert torch.equal(a["x0"], b["x0"]) and torch.equal(a["embeds"], b["embeds"]), step
    assert ahead._executor is not None  # the prefetch ran


@pytest.mark.parametrize("every", [1, 2])
def test_corpus_training_resumes_exactly_with_pool_and_ema(mini_folder, tmp_path, every):
    """The uninterrupted run, and the one stopped after step 3 and resumed, side by side in two processes forked
    from this one (one thread each, so the same sums; the suite has two cores)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file

    from attnqat.train import train
    from conftest import forked_processes

    extra = ("train.from_scratch=true", "train.ema_decay=0.9", f"data.corpus.refresh_every={every}")

    def uninterrupted():
        r = train(_cfg(mini_folder, tmp_path / "a", *extra))
        (tmp_path / "a.json").write_text(json.dumps({"losses": r.losses, "gap_after": r.gap_after}))

    def stopped_and_resumed():
        cfg_b = _cfg(mini_folder, tmp_path / "b", *extra)
        first = train(cfg_b, stop_after=3)
        second = train(cfg_b, resume="auto")
        (tmp_path / "b.json").write_text(json.dumps({"losses": [first.losses, second.losses]}))

    for run in forked_processes(uninterrupted, stopped_and_resumed, timeout=600):
        assert run.returncode == 0, run.stderr[-3000:]
    full = json.loads((tmp_path / "a.json").read_text())
    first, second = json.loads((tmp_path / "b.json").read_text())["losses"]
    assert first + second == full["losses"]  # the pool is rebuilt as it was: identical batches
    assert all(torch.isfinite(torch.tensor(full["losses"])))
    a = load_file(str(tmp_path / "a" / "run" / "final" / "transformer.safetensors"))
    b = load_file(str(tmp_path / "b" / "run" / "final" / "transformer.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ck = tmp_path / "a" / "run" / "checkpoints" / "step-0000006"
    ema = load_file(str(ck / "ema.safetensors"))
    raw = load_file(str(ck / "state" / "model.safetensors"))
    exported = load_file(str(ck / "transformer.safetensors"))
    with safe_open(str(ck / "transformer.safetensors"), framework="pt") as f:
        assert f.metadata()["weights"] == "ema"
    moved = [k for k in ema if not torch.equal(ema[k], raw[k])]
    assert moved, "EMA weights equal the raw weights: the average is not being kept"
    assert all(torch.equal(exported[k], ema[k]) for k in ema)  # save_dtype fp32: exported = EMA exactly
    assert full["gap_after"] is not None and "flow" in full["gap_after"]


def test_from_scratch_is_seeded_and_ignores_the_folders_weights(mini_folder, tmp_path):
    from attnqat.train.loop import Trainer

    t1 = Trainer(_cfg(mini_folder, tmp_path / "x", "train.from_scratch=true", "seed=3"))
    t2 = Trainer(_cfg(mini_folder, tmp_path / "y", "train.from_scratch=true", "seed=3"))
    t3 = Trainer(_cfg(mini_folder, tmp_path / "z", "train.from_scratch=true", "seed=4"))
    p1, p2, p3 = (dict(t.student.named_parameters())["proj_out.weight"] for t in (t1, t2, t3))
    assert torch.equal(p1, p2) and not torch.equal(p1, p3)


def test_held_out_prompt_ratio_is_the_wrong_caption_loss_over_the_right_one(mini_folder, tmp_path):
    """evaluate()'s prompt_ratio (eval_prompt_ratio in log.csv): the held-out flow loss with each clip given the
    next clip's caption over the loss with its own, recomputed here through losses(); and 1 exactly when every
    clip has the same caption (then nothing changes), the control that the ratio measures the captions."""
    from attnqat.train.loop import Trainer

    trainer = Trainer(_cfg(mini_folder, tmp_path / "r", "train.from_scratch=true", "data.held_out=4",
                           "data.batch_size=2"))
    got = trainer.evaluate()["prompt_ratio"]
    right = wrong = 0.0
    for batch in trainer.held_out():
        right += trainer.losses(batch, grad=False)["flow"].item()
        wrong += trainer.losses(dict(batch, embeds=batch["embeds"].roll(1, dims=0)), grad=False)["flow"].item()
    assert got == pytest.approx(wrong / right, rel=1e-5) and got != pytest.approx(1.0, abs=1e-6)
    for batch in trainer.held_out():  # every clip captioned alike
        batch["embeds"][:] = batch["embeds"][:1].clone()
    assert trainer.evaluate()["prompt_ratio"] == pytest.approx(1.0, abs=1e-7)


def test_time_limit_saves_a_checkpoint_and_stops(mini_folder, tmp_path):
    from attnqat.train import train
    from attnqat.train.loop import latest_checkpoint

    cfg = _cfg(mini_folder, tmp_path / "t", "checkpoint.every=100", "train.max_steps=50")
    result = train(cfg, time_limit=0.0)
    assert result.steps == 1 and result.final_checkpoint is None
    assert latest_checkpoint(cfg.output_dir).name == "step-0000001"


@pytest.mark.parametrize("override, message", [
    ("data.corpus.sizes=[[6,32,32]]", r"4k\+1"),
    ("data.corpus.sizes=[[5,24,32]]", "multiples of 16"),
    ("data.corpus.pool=-1", "pool"),
    ("data.corpus.seed=-1", "seed"),
    ("data.corpus.size_weights=[1]", "size_weights"),
    ("data.corpus.refresh=9", "refresh"),
    ("data.corpus.refresh_every=0", "refresh_every"),
    ("data.corpus.refresh_every=3", "refresh_every"),  # 2 x 3 new clips > a pool of 4
    ("data.corpus.caption_dropout=1.5", "caption_dropout"),
    ("train.ema_decay=1.0", "ema_decay"),
    ("data.source=videos", "data.source"),
])
def test_corpus_settings_are_checked(mini_folder, tmp_path, override, message):
    from attnqat.train.config import validate

    with pytest.raises(ValueError, match=message):
        validate(_cfg(mini_folder, tmp_path, override))


def test_corpus_refuses_teacher_latents_it_would_ignore(mini_folder, tmp_path):
    from attnqat.train.config import validate

    with pytest.raises(ValueError, match="latents 'teacher' does not apply"):
        validate(_cfg(mini_folder, tmp_path, "objective.type=distill", "objective.latents=teacher"))
    validate(_cfg(mini_folder, tmp_path, "objective.type=distill", "objective.latents=dataset"))  # accepted


def test_shipped_folder_writer_limits_and_refusals(tmp_path):
    from attnqat.mini.model import check_folder_size, save_pipeline_folder

    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "w.bin").write_bytes(b"\0" * (16 * 2 ** 20))
    with pytest.raises(ValueError, match="MiB"):
        check_folder_size(tmp_path / "big")
    # the total's limit: 24 MB by default, a larger build's own limit where it is given
    (tmp_path / "wide").mkdir()
    for i in range(3):
        (tmp_path / "wide" / f"w{i}.bin").write_bytes(b"\0" * (10 * 10 ** 6))
    with pytest.raises(ValueError, match="30.0 MB, over the 24 MB limit"):
        check_folder_size(tmp_path / "wide")
    assert check_folder_size(tmp_path / "wide", 40 * 10 ** 6) == 30 * 10 ** 6
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError):
        save_pipeline_folder(object(), user)
    assert (user / "notes.txt").read_text() == "keep"


def test_replace_dir_keeps_the_old_folder_until_the_new_one_verifies(tmp_path):
    """The model folders (mini's export, the VAE stage, --ship) are replaced through this: a failed write
    or verification leaves the old folder as it was and no temporary folder behind."""
    from attnqat.outputs import replace_dir_atomically

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "old.txt").write_text("old")

    def reject(tmp):
        raise ValueError("too big")

    with pytest.raises(ValueError, match="too big"):
        replace_dir_atomically(folder, lambda tmp: (tmp / "new.txt").write_text("new"), reject)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert [p.name for p in folder.iterdir()] == ["old.txt"]
    replace_dir_atomically(folder, lambda tmp: (tmp / "new.txt").write_text("new"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert [p.name for p in folder.iterdir()] == ["new.txt"]


def test_mini_missing_is_a_clear_error(monkeypatch, tmp_path):
    from attnqat.mini import model as mini
    from attnqat.pipelines import loading
    from attnqat.pipelines.loading import ModelNotFoundError, resolve_model

    monkeypatch.setattr(mini, "MINI_DIR", tmp_path / "absent")
    with pytest.raises(ModelNotFoundError, match="attnqat build-mini"):
        resolve_model("mini")
    assert loading.resolve_model("tiny") == "tiny"


def test_foreground_weights_mark_saturated_pixels():
    from attnqat.mini.corpus import Corpus
    from attnqat.train.mini import FOREGROUND_WEIGHT, foreground_weights

    c = Corpus(0, "train")
    specs = [c.spec(i) for i in range(6)]
    video = c.render(specs, frames=5, height=64, width=64)
    w = foreground_weights(video)
    share = (w == FOREGROUND_WEIGHT).float().mean().item()
    assert 0.01 < share < 0.2  # the objects, not the backgrounds
    grey = torch.zeros(1, 3, 5, 32, 32)
    assert torch.equal(foreground_weights(grey), torch.ones(1, 1, 5, 32, 32))


def test_gap_closed():
    from attnqat.mini.evaluation import gap_closed

    assert gap_closed(fp4=2.0, qat=1.5, bf16=1.0) == 0.5
    assert gap_closed(fp4=2.0, qat=1.0, bf16=1.0) == 1.0
    assert json.dumps(gap_closed(1.0, 1.0, 1.0)) == "NaN"


def test_flow_metrics_reference_and_a_changed_variant(mini_folder):
    from diffusers import WanTransformer3DModel

    from attnqat.mini.evaluation import Variant, flow_metrics

    tr = WanTransformer3DModel.from_pretrained(str(mini_folder), subfolder="transformer", torch_dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    x0, embeds = torch.randn(3, 16, 2, 4, 4, generator=g), torch.randn(3, 512, 128, generator=g)
    other = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in tr.state_dict().items()}
    before = {k: v.clone() for k, v in tr.state_dict().items()}
    rows = flow_metrics(tr, [Variant("ref"), Variant("moved", weights=other), Variant("again")], x0, embeds, batch=2)
    assert rows["ref"]["velocity_distance"] == 0 and rows["again"]["velocity_distance"] == 0
    assert rows["moved"]["velocity_distance"] > 1e-6 and rows["moved"]["flow_loss"] != rows["ref"]["flow_loss"]
    assert all(torch.equal(v, before[k]) for k, v in tr.state_dict().items())  # base weights restored


def test_mini_tokenizer_reads_every_caption_word_and_user_synonyms(tmp_path):
    """One token per caption word, none unknown (over fresh captions of both splits); synonyms a person
    types become the caption word; the saved tokenizer loads back through AutoTokenizer with the same ids."""
    import random

    from transformers import AutoTokenizer

    from attnqat.mini.corpus import Corpus
    from attnqat.mini.model import build_mini_tokenizer

    tok = build_mini_tokenizer()
    unk = tok.unk_token_id
    start = random.randrange(10 ** 6)
    captions = [Corpus(0, split).caption_of(start + i) for split in ("train", "held_out") for i in range(300)]
    for text in captions:
        ids = tok(text).input_ids
        assert unk not in ids and ids[-1] == tok.eos_token_id, text
        assert len(ids) - 1 == len(text.replace("-", " - ").replace(",", " ,").replace(";", " ;").split()), text
    same = [("A Violet dot rises.", "a purple circle rises"), ("a crimson RECTANGLE", "a red square"),
            ("an aqua pentagram", "an cyan star")]
    for user, caption_text in same:
        assert tok(user).input_ids == tok(caption_text).input_ids
    assert tok("a zebra").input_ids == [tok.convert_tokens_to_ids("a"), unk, tok.eos_token_id]
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    for text in captions[:50] + [u for u, _ in same]:
        assert again(text).input_ids == tok(text).input_ids


def test_warm_start_continues_from_an_exported_build_and_counts_the_chain(tmp_path, capsys):
    """init --from: the exported (EMA, bf16) transformer is the new run's starting point, not a seeded
    random one; the earlier build's timings and steps carry into the next export's card; refusals."""
    from safetensors.torch import load_file

    from diffusers import WanTransformer3DModel

    from attnqat.train.loop import Trainer
    from attnqat.train.mini import main, transformer_config

    small = [a for kv in SMALL + ["train.max_steps=3"] for a in ("--set", kv)]
    first, second = tmp_path / "a", tmp_path / "b"
    assert main(["--out", str(first), "--stage", "init", "--device", "cpu"]) == 0
    (first / "timings.json").write_text('[{"stage": "vae", "seconds": 5.0, "device": "x"}]')  # as if trained
    for stage in ("transformer", "export"):
        assert main(["--out", str(first), "--stage", stage, "--device", "cpu", *small]) == 0
    exported = WanTransformer3DModel.from_pretrained(first / "mini", subfolder="transformer",
                                                     torch_dtype=torch.float32).state_dict()

    assert main(["--out", str(second), "--stage", "init", "--device", "cpu", "--from", str(first / "mini"),
                 "--vae", str(first / "model" / "vae")]) == 0
    cfg = transformer_config(second, SMALL)
    assert cfg.train.from_scratch is False
    start = dict(Trainer(cfg).student.named_parameters())
    assert all(torch.equal(start[k].detach(), exported[k]) for k in start)  # bf16 values, held exactly
    scratch = dict(Trainer(transformer_config(first, SMALL)).student.named_parameters())
    assert not torch.equal(scratch["proj_out.weight"], start["proj_out.weight"])
    # the VAE is --vae's fp32 one, not the folder's fp16 copy
    vae = load_file(str(second / "model" / "vae" / "diffusion_pytorch_model.safetensors"))
    want = load_file(str(first / "model" / "vae" / "diffusion_pytorch_model.safetensors"))
    assert all(torch.equal(vae[k], want[k]) for k in want)

    assert main(["--out", str(second), "--stage", "transformer", "--device", "cpu", *small]) == 0
    assert main(["--out", str(second), "--stage", "export", "--device", "cpu"]) == 0  # the run recorded its --set
    card = json.loads((second / "mini" / "attnqat_mini.json").read_text())
    assert card["config"]["train"]["max_steps"] == 3 and card["config"]["train"]["from_scratch"] is False
    assert card["transformer_steps"] == 6 and [r["steps"] for r in card["runs"]] == [3, 3]
    assert [r["warm_start"] for r in card["runs"]] == [False, True]
    assert [r["stage"] for r in card["timings"]] == ["vae", "transformer", "transformer"]
    assert card["gpu_seconds"]["vae"] == 5.0

    capsys.readouterr()
    for argv, message in [(["--from", str(first / "mini")], "exists already"),  # never over a build's model/
                          (["--from", str(tmp_path)], "no attnqat_mini.json")]:
        with pytest.raises(SystemExit):
            main(["--out", str(second if "exists" in message else tmp_path / "c"), "--stage", "init", *argv])
        assert message in capsys.readouterr().err
    assert not (tmp_path / "c").exists()  # refused before --out is created


def test_compiled_blocks_train_like_eager_ones(mini_folder, tmp_path):
    """train.compile: the same losses as eager to float rounding, the same checkpoint names (the blocks are
    compiled in place, so nothing gains an _orig_mod prefix)."""
    from safetensors.torch import load_file

    from attnqat.train import train

    runs = {}
    for compiled in (False, True):
        cfg = _cfg(mini_folder, tmp_path / str(compiled), "train.from_scratch=true", "train.max_steps=2",
                   "data.held_out=0", f"train.compile={str(compiled).lower()}")
        runs[compiled] = train(cfg).losses
        names = set(load_file(str(tmp_path / str(compiled) / "run" / "final" / "transformer.safetensors")))
        assert not any("_orig_mod" in n for n in names)
        runs[str(compiled)] = names
    torch.testing.assert_close(torch.tensor(runs[True]), torch.tensor(runs[False]), rtol=1e-5, atol=0)
    assert runs["True"] == runs["False"]


def test_compiled_teacher_distils_like_the_eager_one(mini_folder, tmp_path):
    """train.compile in a distillation (the QAT fine-tune's objective): the teacher's blocks are compiled as the
    student's are, and the losses and the held-out gap before training equal the eager run's to float rounding."""
    from attnqat.train import train
    from attnqat.train.loop import Trainer

    compiled_teachers = []
    setup = Trainer.__init__

    def spy(self, *args, **kwargs):
        setup(self, *args, **kwargs)
        compiled_teachers.append(all(b._compiled_call_impl is not None for b in self.teacher.blocks))

    runs = {}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(Trainer, "__init__", spy)
        for compiled in (False, True):
            cfg = _cfg(mini_folder, tmp_path / str(compiled), "train.max_steps=2", "objective.type=distill",
                       "objective.target=output", "attention.mode=attn_qat", f"train.compile={str(compiled).lower()}")
            result = train(cfg)
            runs[compiled] = (result.losses, result.gap_before["output"])  # before AdamW's sign-like first steps
    assert compiled_teachers == [False, True]
    assert runs[False][0][0] > 0  # the student in FP4 is away from its bf16 teacher
    torch.testing.assert_close(torch.tensor(runs[True][0]), torch.tensor(runs[False][0]), rtol=1e-4, atol=0)
    assert runs[True][1] == pytest.approx(runs[False][1], rel=1e-4)


def test_compiled_blocks_may_compile_a_graph_per_block_shape_and_grad_mode(monkeypatch):
    """train.compile's limits cover a deep transformer on many sizes: fullgraph turns Dynamo's recompile limit
    into a hard failure, and a 16-block mini on 6 training sizes hit the old fixed limit of 64 on the GPU."""
    import torch._dynamo

    from attnqat.train.loop import _allow_block_graphs

    cfg = torch._dynamo.config
    monkeypatch.setattr(cfg, "recompile_limit", 8)
    monkeypatch.setattr(cfg, "accumulated_recompile_limit", 256)
    _allow_block_graphs(16, 6)
    assert cfg.recompile_limit >= 16 * 6 * 2 and cfg.accumulated_recompile_limit >= 16 * 6 * 2
    _allow_block_graphs(2, 1)  # never lowered
    assert cfg.recompile_limit >= 16 * 6 * 2


def test_step_profile_reports_every_size_and_part(mini_folder, tmp_path, capsys):
    """bench/profile_mini_step.py (its main, in this process: a subprocess would spend most of the test importing
    torch and diffusers) on a small config: one row per training size with the three parts of a step and the
    refresh's three parts, each a positive time, printed and in its JSON; the build folder is left as it was."""
    import pathlib

    from conftest import load_script

    profile = load_script(pathlib.Path(__file__).resolve().parents[1] / "bench" / "profile_mini_step.py",
                          "profile_mini_step")
    (tmp_path / "model").symlink_to(mini_folder)
    before = sorted(p.name for p in tmp_path.iterdir())
    sets = [a for kv in SMALL for a in ("--set", kv)]
    capsys.readouterr()
    assert profile.main(["--out", str(tmp_path), "--steps", "3", "--warmup", "1", "--json", str(tmp_path / "p.json"),
                         *sets]) == 0
    printed = capsys.readouterr().out
    got = json.loads((tmp_path / "p.json").read_text())
    assert set(got["per_step_s"]) == set(got["refresh_parts_s"]) == {"5x32x32", "9x32x64"}
    for row in got["per_step_s"].values():
        assert set(row) == {"batch", "forward_backward", "optimizer_ema"} and all(v > 0 for v in row.values())
    for row in got["refresh_parts_s"].values():
        assert set(row) == {"render", "vae_encode", "embed"} and all(v > 0 for v in row.values())
    for key, row in got["per_step_s"].items():
        assert f"{key}: step {sum(row.values()) * 1e3:.1f} ms" in printed, printed
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before + ["p.json"])


def test_loop_profile_times_each_size_and_every_refresh(mini_folder, tmp_path, capsys):
    """bench/profile_mini_step.py --loop (in this process) on a small config: per variant, each size's step times
    from the loop's own log, the run's clock over the timed steps at least their sum, one wait for each refresh the
    timed and untimed steps made, and the class it timed left as it was."""
    import pathlib

    from conftest import load_script

    from attnqat.train.corpus_source import CorpusSource

    profile = load_script(pathlib.Path(__file__).resolve().parents[1] / "bench" / "profile_mini_step.py",
                          "profile_mini_step")
    (tmp_path / "model").symlink_to(mini_folder)
    capsys.readouterr()
    original = CorpusSource._refresh_clips
    sets = [a for kv in SMALL for a in ("--set", kv)]
    assert profile.main(["--out", str(tmp_path), "--loop", "eager", "--loop-steps", "4", "--loop-warmup", "2",
                         "--json", str(tmp_path / "p.json"), *sets]) == 0
    assert CorpusSource._refresh_clips is original
    r = json.loads((tmp_path / "p.json").read_text())["variants"]["eager"]
    # steps 3-6 of the 2:1 pattern (5x32x32, 5x32x32, 9x32x64 from step 1): 9x32x64, 5x32x32, 5x32x32, 9x32x64
    assert {k: v["steps"] for k, v in r["per_size"].items()} == {"5x32x32": 2, "9x32x64": 2}
    assert all(v["median_ms"] > 0 for v in r["per_size"].values())
    assert r["clock_mean_ms"] * 4 >= r["mean_ms"] * 4 > 0
    # refresh_every=1: one refresh a step, warm-up included (a size's first fills its pool the same way)
    assert len(r["refresh_waits_ms"]) == 6 and all(w > 0 for w in r["refresh_waits_ms"])
    medians = {k: v["median_ms"] for k, v in r["per_size"].items()}
    assert all(step > 2 and ms > 3 * medians[size] for step, size, ms in r["slow_steps"])
    assert "refreshes waited" in capsys.readouterr().out


def test_loop_profile_encodes_the_pool_as_the_vae_variant_asked(mini_folder, tmp_path):
    """profile_mini_step --loop --vae-variant plain: every refresh's encode sees float32 NCDHW convolution weights and
    clips (bench/vae_encode.py's variant), where the library's own encode is channels-last, and the class is as it
    was after."""
    import pathlib

    import torch
    from conftest import load_script

    from attnqat.train.corpus_source import CorpusSource

    profile = load_script(pathlib.Path(__file__).resolve().parents[1] / "bench" / "profile_mini_step.py",
                          "profile_mini_step")
    (tmp_path / "model").symlink_to(mini_folder)
    seen = []
    original = CorpusSource.encode_video, CorpusSource.__init__

    def spy(self, video):
        conv = next(m for m in self.vae.modules() if isinstance(m, torch.nn.Conv3d))
        seen.append((self.channels_last, conv.weight.is_contiguous(memory_format=torch.channels_last_3d),
                     conv.weight.dtype))
        return original[0](self, video)

    CorpusSource.encode_video = spy
    try:
        sets = [a for kv in SMALL for a in ("--set", kv)]
        for variant, want in (("plain", (False, False, torch.float32)), ("default", (True, True, torch.float32))):
            seen.clear()
            assert profile.main(["--out", str(tmp_path), "--loop", "eager", "--loop-steps", "1", "--loop-warmup", "1",
                                 "--vae-variant", variant, *sets]) == 0
            assert seen and all(v == want for v in seen), variant
            assert (CorpusSource.encode_video, CorpusSource.__init__) == (spy, original[1])
    finally:
        CorpusSource.encode_video = original[0]
    with pytest.raises(SystemExit):
        profile.main(["--out", str(tmp_path), "--vae-variant", "plain"])  # a loop is what it times


def test_loop_trace_summary_finds_the_idle_gaps_and_each_streams_work(tmp_path):
    """bench/profile_mini_step.py's trace summary (--trace; the trace itself needs a GPU) on a hand-made Chrome
    trace: the busy time is the union of overlapping kernels on two streams, the gaps are the spans no kernel
    covers, each named with the host calls under way when it began, and each stream's own total."""
    import gzip
    import pathlib

    from conftest import load_script

    profile = load_script(pathlib.Path(__file__).resolve().parents[1] / "bench" / "profile_mini_step.py",
                          "profile_mini_step")
    k = lambda ts, dur, name, tid: {"cat": "kernel", "ts": ts, "dur": dur, "name": name, "tid": tid}  # noqa: E731
    events = [k(0, 100, "gemm", 7), k(50, 100, "conv", 30), k(400, 100, "gemm", 7), k(700, 20, "copy", 30),
              {"cat": "cuda_runtime", "ts": 140, "dur": 300, "name": "cudaStreamSynchronize", "tid": 1},
              {"cat": "cpu_op", "ts": 480, "dur": 150, "name": "aten::item", "tid": 1}]
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    got = profile._idle(path)
    assert got["span_ms"] == 0.72 and got["gpu_busy_ms"] == 0.27 and got["idle_ms"] == 0.45  # busy: 150 + 100 + 20
    assert got["gaps_over_50us"] == 2
    assert got["longest_gaps"] == [{"ms": 0.25, "host": ["cudaStreamSynchronize"]},
                                   {"ms": 0.2, "host": ["aten::item"]}]
    assert got["top_kernels_ms"] == {"gemm": 0.2, "conv": 0.1, "copy": 0.02}
    assert got["streams_ms"] == {"7": {"total": 0.2, "top": {"gemm": 0.2}},
                                 "30": {"total": 0.12, "top": {"conv": 0.1, "copy": 0.02}}}


def test_vae_encode_bench_compares_variants_with_todays_encode(tmp_path, capsys):
    """bench/vae_encode.py on the shipped mini, tiny clips on the CPU: a time for each variant, the default's latents
    as the reference (difference 0, and its second run within float rounding of its first), the plain and
    channels-last latents within float rounding of them, and the VAE given back as the library sets it up
    (float32, channels-last convolution weights on a CPU) after each variant."""
    import pathlib

    import torch
    from conftest import load_script

    from attnqat.train import corpus_source

    bench = load_script(pathlib.Path(__file__).resolve().parents[1] / "bench" / "vae_encode.py", "bench_vae_encode")
    seen = []
    real = corpus_source.CorpusSource.encode_video

    def spy(self, video):
        compiled = [m._compiled_call_impl is not None for m in self.vae.encoder.modules()
                    if type(m).__name__ == "WanRMS_norm"]
        seen.append((self, self.channels_last, all(compiled) if any(compiled) else False))
        return real(self, video)

    corpus_source.CorpusSource.encode_video = spy
    try:
        assert bench.main(["--size", "5x32x32", "--clips", "1", "--repeats", "1", "--warmup", "0", "--device", "cpu",
                           "--json", str(tmp_path / "v.json")]) == 0
    finally:
        corpus_source.CorpusSource.encode_video = real
    rows = json.loads((tmp_path / "v.json").read_text())["variants"]
    # bf16_weights is CUDA-only
    assert list(rows) == ["default", "plain", "channels_last", "compiled_norms", "benchmark", "default_again"]
    assert all(r["median_ms"] > 0 for r in rows.values())
    assert rows["default"]["max_diff_over_rms"] == 0
    assert all(0 <= rows[k]["max_diff_over_rms"] < 1e-4
               for k in ("plain", "channels_last", "compiled_norms", "default_again"))
    assert [c for _, c, _ in seen] == [True, False, True, True, True, True]  # plain encodes NCDHW clips
    assert [c for _, _, c in seen] == [False, False, False, True, False, False]  # every norm compiled, in its variant
    src = seen[-1][0]
    for m in src.vae.modules():
        if isinstance(m, torch.nn.Conv3d):
            assert m.weight.dtype == torch.float32 and m.weight.is_contiguous(memory_format=torch.channels_last_3d)
    norms = [m for m in src.vae.encoder.modules() if type(m).__name__ == "WanRMS_norm"]
    assert norms and all(m._compiled_call_impl is None for m in norms)  # compiled_norms undone
    assert "channels_last" in capsys.readouterr().out


def test_vae_trains_on_every_size_in_turn_with_a_pixel_budget(monkeypatch):
    """train_vae cycles through its sizes (the VAE must see every clip length it will be used at), with
    vae_batch's clip count at each (about the pixels of ``batch`` 17x128x128 clips), on fresh clips, and learns."""
    from diffusers import AutoencoderKLWan

    from attnqat.mini.corpus import Corpus
    from attnqat.train.mini import VAE_SIZES, train_vae, vae_batch

    # the longest clip trains every shorter length (the VAE is causal: next test), one latent frame past the
    # longest the model is used at; single frames weigh the first frame's own path
    assert {h for _, h, _ in VAE_SIZES} == {128, 256} and max(f for f, _, _ in VAE_SIZES) > 49
    assert {(f, h) for f, h, _ in VAE_SIZES} == {(1, 128), (1, 256), (57, 128), (57, 256)}
    assert vae_batch((17, 128, 128), 8) == 8 and vae_batch((33, 256, 256), 16) == 2 and vae_batch((57, 256, 256), 1) == 1
    assert vae_batch((5, 32, 32), 1) == 54 and vae_batch((5, 32, 32), 0.02) == 1  # a fraction: small steps (tests)
    seen, drawn, render, spec = [], [], Corpus.render, Corpus.spec

    def spy_render(specs, **kw):
        seen.append(((kw["frames"], kw["height"], kw["width"]), len(specs)))
        return render(specs, **kw)

    def spy_spec(self, index):
        drawn.append(index)
        return spec(self, index)

    monkeypatch.setattr(Corpus, "render", staticmethod(spy_render))
    monkeypatch.setattr(Corpus, "spec", spy_spec)
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True])
    before = {k: v.clone() for k, v in vae.state_dict().items()}
    sizes = ((5, 32, 32), (9, 32, 64))
    facts = train_vae(vae, seconds=600, steps=4, batch=2, sizes=sizes, device="cpu", log=lambda *_: None,
                      reference_voxels=5 * 32 * 32)
    assert [s for s, _ in seen] == [sizes[0], sizes[1], sizes[0], sizes[1]]
    assert [n for _, n in seen] == [2, 1, 2, 1] == [vae_batch(s, 2, 5 * 32 * 32) for s, _ in seen]
    assert len(set(drawn)) == len(drawn) == facts["clips"] == sum(n for _, n in seen)  # every clip a new one
    assert facts["steps"] == 4
    assert any(not torch.equal(before[k], v) for k, v in vae.state_dict().items())


def _tiny_wan_vae(**kw):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                            temperal_downsample=[False, True, True], **kw).eval()


def test_wan_vae_round_trips_are_causal_so_the_longest_clip_trains_every_length():
    """The round trip of a clip's first N frames equals that of the N-frame clip, bit for bit (VAE_SIZES
    rests on it: 57-frame clips train every shorter length)."""
    vae = _tiny_wan_vae()
    clip = torch.rand(1, 3, 17, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        trip = lambda x: vae.decode(vae.encode(x).latent_dist.mode()).sample  # noqa: E731
        whole = trip(clip)
        for n in (1, 5, 9):
            assert torch.equal(trip(clip[:, :, :n]), whole[:, :, :n])
        later = clip.clone()
        later[:, :, 9:] = -later[:, :, 9:]  # later frames changed: the first 9 come back the same
        assert torch.equal(trip(later)[:, :, :9], whole[:, :, :9]) and not torch.equal(trip(later), whole)


def test_a_new_decoder_of_another_width_decodes_the_same_latents():
    from attnqat.train.mini import with_new_decoder

    vae = _tiny_wan_vae()
    wide = with_new_decoder(vae, 16)
    assert wide.config.decoder_base_dim == 16 and wide.config.base_dim == 8
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n(wide.decoder) > 3 * n(vae.decoder) and n(wide.encoder) == n(vae.encoder)
    clip = torch.rand(2, 3, 5, 32, 32, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        z = vae.encode(clip).latent_dist.mode()
        assert torch.equal(wide.eval().encode(clip).latent_dist.mode(), z)
        assert wide.decode(z).sample.shape == clip.shape
    assert torch.equal(with_new_decoder(vae, 16).decoder.conv_out.weight, wide.decoder.conv_out.weight)  # seeded


def test_decoder_only_vae_training_keeps_the_latents_exactly():
    """decoder_only freezes the encoder side bit for bit (so the latents a transformer learned stay valid) and
    trains the decoder; the whole-VAE default changes the encoder too."""
    from diffusers import AutoencoderKLWan

    from attnqat.mini.corpus import Corpus
    from attnqat.train.mini import train_vae

    def trained(decoder_only):
        torch.manual_seed(0)
        vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True])
        before = {k: v.clone() for k, v in vae.state_dict().items()}
        train_vae(vae, seconds=600, steps=2, batch=1, sizes=((5, 32, 32),), device="cpu", log=lambda *_: None,
                  reference_voxels=5 * 32 * 32, decoder_only=decoder_only)
        changed = {k.split(".")[0] for k, v in vae.state_dict().items() if not torch.equal(before[k], v)}
        return vae, changed

    vae, changed = trained(True)
    assert changed == {"decoder", "post_quant_conv"}
    c = Corpus(0, "held_out")
    clip = c.render([c.spec(0)], frames=5, height=32, width=32)
    torch.manual_seed(0)
    fresh = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True])
    with torch.no_grad():
        assert torch.equal(vae.encode(clip).latent_dist.mode(), fresh.eval().encode(clip).latent_dist.mode())
    assert {"encoder", "decoder"} <= trained(False)[1]


class _CorruptingVAE(torch.nn.Module):
    """A round trip that returns the clip with frames >= ``start`` shifted by ``shift`` (a late collapse)."""

    def __init__(self, start: int, shift: float):
        super().__init__()
        self.start, self.shift = start, shift
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # where the clips go: CPU, fp32

    def encode(self, video):
        from types import SimpleNamespace

        return SimpleNamespace(latent_dist=SimpleNamespace(mode=lambda: video.clone()))

    def decode(self, z):
        from types import SimpleNamespace

        out = z.clone()
        out[:, :, self.start:] += self.shift
        return SimpleNamespace(sample=out)


def test_reconstruction_per_frame_shows_a_late_collapse_that_the_mean_hides():
    """reconstruction_per_frame against an independent per-frame PSNR (numpy): frames before the collapse are
    exact (capped at 100 dB), the collapsed ones at the PSNR of their error; the detector still reads the
    objects before it, and the mean alone stays high."""
    import numpy as np

    from attnqat.mini.corpus import Corpus
    from attnqat.train.mini import reconstruction_per_frame

    start, shift, size = 6, 0.2, (9, 64, 64)
    got = reconstruction_per_frame(_CorruptingVAE(start, shift), clips=3, size=size, device="cpu")
    c = Corpus(0, "held_out")
    video = c.render([c.spec(j) for j in range(3)], frames=size[0], height=size[1], width=size[2]).double().numpy()
    recon = np.clip(video + np.where(np.arange(size[0])[None, None, :, None, None] >= start, shift, 0.0), -1, 1)
    mse = (((recon - video) / 2) ** 2).mean(axis=(1, 3, 4))  # (clips, frames)
    want = np.minimum(10 * np.log10(1 / np.maximum(mse, 1e-30)), 100)
    np.testing.assert_allclose(got["frame_db"], want.mean(0), atol=0.01)
    np.testing.assert_allclose(got["worst_db"], want.min(0), atol=0.01)
    assert got["mean_db"] == pytest.approx(want.mean(), abs=0.01)
    assert min(got["frame_db"][:start]) == 100 and max(got["frame_db"][start:]) < 30  # the collapse, per frame
    assert got["mean_db"] > 60  # ... which the mean alone hides
    assert min(got["object_db"][:start]) == 100 and max(got["object_db"][start:]) < 30
    assert min(got["colour"][:start]) == 1.0 and len(got["colour"]) == len(got["shape"]) == size[0]


def test_init_builds_a_transformer_of_the_size_asked(tmp_path):
    """--transformer-size (a capacity sweep) changes the untrained transformer's dimensions and nothing else."""
    import json

    from attnqat.mini.model import MINI_TRANSFORMER_CONFIG
    from attnqat.train.mini import main

    assert main(["--out", str(tmp_path / "o"), "--stage", "init", "--device", "cpu",
                 "--transformer-size", "heads=2,layers=3,ffn=96"]) == 0
    got = json.loads((tmp_path / "o" / "model" / "transformer" / "config.json").read_text())
    want = {**MINI_TRANSFORMER_CONFIG, "num_attention_heads": 2, "num_layers": 3, "ffn_dim": 96}
    assert {k: got[k] for k in want} == {k: (list(v) if isinstance(v, tuple) else v) for k, v in want.items()}


@pytest.mark.parametrize("args, message", [
    (["--transformer-size", "heads=6,depth=2"], "KEY=N with KEY one of heads, layers, ffn"),
    (["--transformer-size", "heads=0"], "N >= 1"),
    (["--max-folder-mb", "41"], "must be in \\(0, 40\\]"),
    (["--max-folder-mb", "nan"], "must be in"),
    (["--transformer-size", "heads=6", "--from", "elsewhere"], "a warm start \\(--from\\) keeps its own"),
])
def test_capacity_arguments_are_checked(tmp_path, capsys, args, message):
    from attnqat.train.mini import main

    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "o"), "--stage", "init", *args])
    assert e.value.code == 2 and re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("stage", ["all", "transformer"])
def test_training_settings_are_checked_before_the_first_stage(tmp_path, capsys, stage):
    """A bad --set fails before init and the VAE's minutes, not when the transformer stage reads it."""
    from attnqat.train.mini import main

    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "o"), "--stage", stage, "--device", "cpu", "--set", "train.max_steps=2"])
    assert e.value.code == 2 and "train.warmup_steps 300 > train.max_steps 2" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("extra", [[], ["--transformer-size", "heads=2,layers=2"]])
def test_good_training_settings_pass_the_early_check_on_a_fresh_folder(tmp_path, extra):
    import argparse

    from attnqat.train import mini

    p = argparse.ArgumentParser()
    mini.add_arguments(p)
    args = p.parse_args(["--out", str(tmp_path / "o"), "--device", "cpu", "--set", "train.max_steps=400", *extra])
    mini.check_arguments(args)  # no model folder yet: checked against the transformer init will write
    planned = mini._planned_transformer_config(tmp_path / "o", args)
    assert planned["num_layers"] == (2 if extra else 8) and planned["num_attention_heads"] == (2 if extra else 4)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("value, message", [("33x128", "expected FxHxW"), ("32x128x128", "4k\\+1"),
                                            ("33x100x128", "multiples of 16"), ("9x16x32", "at least 32"), ("a", "expected FxHxW")])
def test_vae_sizes_are_checked(tmp_path, capsys, value, message):
    from attnqat.train.mini import main

    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "o"), "--stage", "vae", "--vae-sizes", value])
    assert e.value.code == 2 and re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "o").exists()
