"""data.corpus.compact_text (attnqat/train/compact_text.py): cross-attention over the first L rows of the prompt
embeddings, the last standing for all the zero padding, equals cross-attention over the whole 512 (fp32, CPU): the
transformer's output and gradients, the corpus's embeddings, and a training run's losses; settings it cannot serve
are refused."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnqat.pipelines.loading import resolve_model
from attnqat.train.compact_text import CompactTextProcessor, install

TEXT_LEN = 512
MINI = str(resolve_model("mini"))  # the shipped folder, read only


def _transformer():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)  # random weights of mini's architecture: every projection and norm matters, none trained
    return WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(MINI, subfolder="transformer"))


def _inputs(tc, lengths):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(lengths), tc.in_channels, 3, 8, 8, generator=g)
    embeds = torch.zeros(len(lengths), TEXT_LEN, tc.text_dim)
    for i, n in enumerate(lengths):  # each prompt's rows, then zeros, as WanPipeline pads
        embeds[i, :n] = torch.randn(n, tc.text_dim, generator=g)
    return x, torch.tensor([300.0, 800.0]), embeds


def _run(model, x, t, embeds):
    model.zero_grad(set_to_none=True)
    out = model(hidden_states=x, timestep=t, encoder_hidden_states=embeds, return_dict=False)[0]
    (out.square().mean()).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("keep", [8, 32])
def test_compact_cross_attention_equals_the_padded_one(keep):
    model = _transformer()
    x, t, embeds = _inputs(model.config, [3, 7])
    want, want_grads = _run(model, x, t, embeds)
    install(model, TEXT_LEN)
    assert all(isinstance(b.attn2.processor, CompactTextProcessor) for b in model.blocks)
    got, got_grads = _run(model, x, t, embeds[:, :keep])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:  # the text embedder's too: its bias row reaches every padded key
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    # whole embeddings run diffusers' processor as they did
    again, _ = _run(model, x, t, embeds)
    assert torch.equal(again, want)


def test_the_padding_weight_is_what_makes_it_equal():
    """The control: the same cut without the last key standing for the rest (its logit not raised) differs."""
    model = _transformer()
    x, t, embeds = _inputs(model.config, [3, 7])
    want, _ = _run(model, x, t, embeds)
    install(model, text_len=8)  # "8 rows are all there is": no padded row beyond them
    got, _ = _run(model, x, t, embeds[:, :8])
    assert (got - want).abs().max() > 1e-3


def test_corpus_cuts_the_embeddings_and_refuses_a_caption_too_long():
    from attnqat.train.config import CorpusConfig
    from attnqat.train.corpus_source import CorpusSource

    whole = CorpusSource(MINI, CorpusConfig(sizes=[[5, 32, 32]], pool=0), text_len=TEXT_LEN, device="cpu")
    cut = CorpusSource(MINI, CorpusConfig(sizes=[[5, 32, 32]], pool=0, compact_text=12), text_len=TEXT_LEN,
                       device="cpu")
    captions = ["a red ball slides left over a striped background", ""]
    full = whole.embed(captions)
    got = cut.embed(captions)
    assert got.shape == (2, 12, full.shape[2])
    assert torch.equal(got, full[:, :12]) and torch.equal(got[:, -1], torch.zeros_like(got[:, -1]))
    assert not full[:, 12:].any()  # what was cut is padding
    with pytest.raises(ValueError, match=r"compact_text 12: a caption of \d+ tokens"):
        cut.embed(["a red ball " * 6])


def _cfg(out: Path, *sets: str):
    from attnqat.train.mini import transformer_config

    small = ["data.corpus.sizes=[[5,32,32]]", "data.corpus.size_weights=null", "data.batch_size=2", "data.corpus.pool=4",
             "data.corpus.refresh=2", "data.corpus.refresh_every=1", "data.corpus.encode_batch=2", "data.held_out=2",
             "train.max_steps=2", "train.warmup_steps=1", "checkpoint.every=2", "log.every=1", "log.eval_every=1",
             'train.mixed_precision="no"', "log.progress=false", "train.from_scratch=true"]
    cfg = transformer_config(out, [*small, *sets])
    cfg.model = MINI
    return cfg


@pytest.mark.slow  # two short training runs on the corpus (~40 s on 2 cores)
def test_training_with_compact_text_has_the_padded_runs_losses(tmp_path, monkeypatch):
    from attnqat.train import compact_text, train

    runs = {keep: train(_cfg(tmp_path / str(keep), "objective.type=distill", f"data.corpus.compact_text={keep}"))
            for keep in (0, 32)}
    assert len(runs[0].losses) == 2
    torch.testing.assert_close(torch.tensor(runs[32].losses), torch.tensor(runs[0].losses), rtol=1e-5, atol=0)
    for key in ("output", "flow"):  # the held-out evaluation, through the same processors
        torch.testing.assert_close(torch.tensor(runs[32].gap_after[key]), torch.tensor(runs[0].gap_after[key]),
                                   rtol=1e-5, atol=0)
    # the control: the embeddings cut but diffusers' processor left in place (the padding's weight lost)
    monkeypatch.setattr(compact_text, "install", lambda *a, **k: None)
    cut_only = train(_cfg(tmp_path / "cut_only", "objective.type=distill", "data.corpus.compact_text=32"))
    assert abs(cut_only.gap_after["flow"] - runs[0].gap_after["flow"]) > 1e-4 * abs(runs[0].gap_after["flow"])


@pytest.mark.parametrize("sets, message", [
    (("data.corpus.compact_text=1",), "from 2 to data.text_len - 1"),
    (("data.corpus.compact_text=512",), "from 2 to data.text_len - 1"),
    (("data.corpus.compact_text=true",), "compact_text must be an integer"),
    (("data.corpus.compact_text=32", "data.source=precomputed"), "data.source is 'precomputed'"),
    (("data.corpus.compact_text=32", "attention.layers=all"), "layers 'all'"),
])
def test_settings_it_cannot_serve_are_refused(tmp_path, sets, message):
    from attnqat.train.config import validate

    with pytest.raises(ValueError, match=message):
        validate(_cfg(tmp_path, *sets))


@pytest.mark.gpu
def test_gpu_compiled_bf16_compact_cross_attention_is_the_padded_one():
    """On the GPU, under bf16 autocast and with each block compiled (fullgraph), as training runs it: the compact
    cross-attention (float32 SDPA with the padding's logit bias) against diffusers' bf16 SDPA over all 512 keys:
    the outputs within bf16's rounding of each other."""
    model = _transformer().cuda()
    x, t, embeds = (v.cuda() for v in _inputs(model.config, [3, 7]))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want, _ = _run(model, x, t, embeds)
        install(model, TEXT_LEN)
        for block in model.blocks:
            block.compile(dynamic=False, fullgraph=True)
        got, grads = _run(model, x, t, embeds[:, :32])
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 1e-2, err
    assert all(torch.isfinite(g).all() for g in grads.values())
