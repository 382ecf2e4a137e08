"""The ``mini`` model: a small Wan 2.1-architecture text-to-video model trained by this project.

It is trained from scratch on the procedural captioned-video corpus (:mod:`attnqat.mini.corpus`: coloured
shapes moving over simple backgrounds, with English captions) and ships inside the package as an
ordinary diffusers-format folder, so it loads through the same ``WanPipeline.from_pretrained(folder)``
path as real Wan weights. Every component is Wan 2.1's class, only smaller:

- tokenizer: a word-level ``PreTrainedTokenizerFast``, one token per word of the corpus's captions
  (:func:`attnqat.mini.corpus.caption_words`, 114 words), lowercased, other characters than letters and
  ``, ; -`` dropped, common synonyms a person may type read as the caption word
  (:data:`attnqat.mini.corpus.WORD_SYNONYMS`: "violet" is "purple"), ``<unk>`` for any other word. A byte-level tokenizer (one token per byte) was tried first: after
  2,370 steps the transformer had learnt to ignore the prompt (the flow loss with a wrong caption
  was within 1% of the right one's, and no sample had the asked colour), because a frozen encoder
  gives the cross-attention no single position that says "red";
- text encoder: ``UMT5EncoderModel`` (2 layers, d_model 128), **frozen at its seeded random
  initialisation**: with one token per word, each colour, shape and motion word keeps a distinct
  random vector through the residual stream, and the transformer's cross-attention learns to read
  them. Training it too would add a second optimiser path to the loop, and keeps the text side out
  of every FP4-versus-bf16 comparison (only the transformer's attention changes between modes);
- VAE: ``AutoencoderKLWan`` (base_dim 24, z_dim 16, Wan's 4x temporal / 8x spatial compression),
  trained for reconstruction on the corpus (:mod:`attnqat.train.mini`);
- transformer: ``WanTransformer3DModel``, 8 blocks of 4 heads x head_dim 64 (9.1M parameters), trained
  with ``attnqat train`` (flow matching on the corpus, bf16 attention, EMA weights);
- scheduler: ``UniPCMultistepScheduler`` in flow-prediction mode, as Wan 2.1 ships it.

``attnqat build-mini`` reproduces the whole model from scratch (docs/mini.md).
"""
from __future__ import annotations

import os
from pathlib import Path

from attnqat.outputs import replace_dir_atomically

from attnqat.pipelines.wan_configs import wan_transformer_config

# torch is imported where it is used: `attnqat generate --help` reads the default model from here.

#: Where the shipped weights live (package data).
MINI_DIR = Path(__file__).resolve().parent.parent / "models" / "mini"

#: The QAT fine-tune shipped beside mini's folder (``MINI_DIR / MINI_QAT_WEIGHTS``): only the transformer tensors
#: it changed, as bf16 values or FP8 changes (:mod:`attnqat.pipelines.qat_weights`). ``attnqat generate --mode attn_qat`` on mini and the
#: demo's Attn-QAT column run on it unless --qat-checkpoint names other weights (or ``none``).
MINI_QAT_WEIGHTS = "attn_qat.safetensors"

#: The model ``attnqat generate``, ``app.py`` (the demo) and ``attnqat quality`` use when --model is not given.
DEFAULT_MODEL = "mini"
#: What ``generate`` and ``app.py`` run instead of :data:`DEFAULT_MODEL` while THIS installation has no mini
#: weights (a checkout from before ``attnqat/models/mini/`` was committed), printing :data:`MINI_MISSING_NOTE`.
#: Once the folder ships, :func:`default_model` is :data:`DEFAULT_MODEL` on every installation and this
#: fallback never triggers. ``attnqat quality`` never falls back (scores of random weights would mean
#: nothing): it stops with :func:`mini_folder`'s error instead.
FALLBACK_MODEL = "tiny"
MINI_MISSING_NOTE = ("the default model 'mini' is not in this installation (attnqat/models/mini/ holds no weights), "
                     "so --model defaults to 'tiny'; pass --model tiny to silence this note, or build mini with "
                     "`attnqat build-mini` (docs/mini.md)")
#: One line on what mini can draw (it knows only the procedural corpus's world), for summaries and pages.
MINI_NOTICE = ("model 'mini' is attnqat's own small Wan 2.1-architecture model, trained on its procedural corpus: "
               "it draws one coloured shape moving over a simple background, e.g. \"a blue square moves up over a "
               "checkered background\"")

#: What mini does know, after the words of a prompt it does not (:func:`vocabulary_note`).
MINI_KNOWS = "it knows colours, shapes, motions and backgrounds: see docs/corpus.md"
MAX_UNKNOWN_SHOWN = 12  # a prompt of many unknown words: the note names this many, then counts the rest

MINI_TEXT_DIM = 128
MINI_TEXT_ENCODER_CONFIG = dict(d_model=MINI_TEXT_DIM, d_kv=32, d_ff=256, num_layers=2, num_heads=4,
                                relative_attention_num_buckets=16, relative_attention_max_distance=64,
                                feed_forward_proj="gated-gelu", dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                                decoder_start_token_id=0)
MINI_VAE_CONFIG = dict(base_dim=24, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                       temperal_downsample=[False, True, True])
MINI_TRANSFORMER_CONFIG = wan_transformer_config(
    num_attention_heads=4,
    attention_head_dim=64,     # the FP4 kernels' head_dim (64 or 128), as Wan 1.3B/14B have 128
    text_dim=MINI_TEXT_DIM,    # = the text encoder's d_model
    freq_dim=256,
    ffn_dim=1024,
    num_layers=8,
)
MINI_FLOW_SHIFT = 3.0

# Seeds of the random initialisations (the text encoder keeps its initialisation for good).
_SEED_TEXT_ENCODER, _SEED_VAE, _SEED_TRANSFORMER = 10, 11, 12

#: Size limits of the shipped folder: the repository stays light.
MAX_FILE_BYTES = 15 * 2 ** 20
MAX_FOLDER_BYTES = 24 * 10 ** 6
#: ... and the most a larger build may take (``attnqat build-mini --max-folder-mb``), where measurements show that
#: the 24 MB model cannot meet a quality bar: a wider transformer or VAE, the CPU quick start still under a minute.
MAX_LARGER_FOLDER_BYTES = 40 * 10 ** 6
#: ... and of the QAT weights beside it (:data:`MINI_QAT_WEIGHTS`), not counted in MAX_FOLDER_BYTES: a folder of
#: 22.7 MB leaves no room for them, and mini's attention tensors alone are ~4 MB.
MAX_QAT_WEIGHTS_BYTES = 12 * 10 ** 6

#: The transformer dimensions a build may change (``attnqat build-mini --transformer-size``), by their short names.
TRANSFORMER_SIZE_KEYS = {"heads": "num_attention_heads", "layers": "num_layers", "ffn": "ffn_dim"}


def is_mini(model: str) -> bool:
    return model.strip().lower() == "mini"


def mini_installed() -> bool:
    """Whether this installation holds mini's weights (``MINI_DIR/model_index.json``)."""
    return (MINI_DIR / "model_index.json").is_file()


def is_shipped_mini(model: str) -> bool:
    """``mini``, or the shipped folder (:data:`MINI_DIR`) given as a path."""
    if is_mini(model):
        return True
    try:
        return Path(model).expanduser().resolve() == MINI_DIR.resolve()
    except (OSError, ValueError, RuntimeError):  # a name no path can have, a symlink loop
        return False


def shipped_qat_weights(model: str) -> Path | None:
    """The QAT fine-tune installed with ``model`` (``MINI_DIR / MINI_QAT_WEIGHTS`` for the shipped mini, when
    that file is there), else None."""
    path = MINI_DIR / MINI_QAT_WEIGHTS
    return path if is_shipped_mini(model) and path.is_file() else None


def default_model() -> str:
    """The --model of ``attnqat generate`` and ``app.py`` when none is given: :data:`DEFAULT_MODEL` ("mini")
    whenever its weights are installed, which is always once ``attnqat/models/mini/`` is committed;
    :data:`FALLBACK_MODEL` ("tiny") only on an installation without them (callers print
    :data:`MINI_MISSING_NOTE` then)."""
    return DEFAULT_MODEL if mini_installed() else FALLBACK_MODEL


def mini_folder() -> Path:
    """The shipped ``mini`` folder; :class:`FileNotFoundError` with the way to build it when absent."""
    if not mini_installed():
        raise FileNotFoundError(f"the mini model's weights are not in this installation ({MINI_DIR} has no "
                                f"model_index.json); rebuild them with `attnqat build-mini` "
                                f"(docs/mini.md) or use --model tiny")
    return MINI_DIR


def build_mini_tokenizer():
    """The word-level tokenizer (module docstring), built in memory; T5-style specials.

    Ids: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, then one id per caption word in sorted order.
    """
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from attnqat.mini.corpus import WORD_SYNONYMS, caption_words

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for word in caption_words():
        vocab[word] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Lowercase(), normalizers.Replace(Regex(r"[^a-z,;\-\s]+"), " ")]
        + [normalizers.Replace(Regex(rf"\b{word}\b"), canonical) for word, canonical in sorted(WORD_SYNONYMS.items())])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # words (\w+) and punctuation runs
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=512)


def unknown_words(tokenizer, prompt: str) -> list[str]:
    """The words of ``prompt`` that ``tokenizer`` (mini's word-level one) reads only as ``<unk>``: lowercased,
    once each, in the prompt's order. A word is a run of letters (with inner apostrophes: "cat's"); digits
    and punctuation are no words. A synonym the tokenizer maps ("violet") is known."""
    import re

    words = list(dict.fromkeys(w.lower() for w in re.findall(r"[^\W\d_]+(?:['’][^\W\d_]+)*", prompt)))
    unk = tokenizer.unk_token_id
    return [w for w in words if unk in tokenizer(w, add_special_tokens=False)["input_ids"]]


def vocabulary_note(tokenizer, prompt: str) -> str | None:
    """One line naming the words of ``prompt`` mini does not know (:func:`unknown_words`; the first
    :data:`MAX_UNKNOWN_SHOWN`, then how many more), and what it does know; None when it knows them all."""
    words = unknown_words(tokenizer, prompt)
    if not words:
        return None
    shown = ", ".join(words[:MAX_UNKNOWN_SHOWN])
    more = f" and {len(words) - MAX_UNKNOWN_SHOWN} more" if len(words) > MAX_UNKNOWN_SHOWN else ""
    return f"mini does not know: {shown}{more} ({MINI_KNOWS})"


def build_mini_text_encoder():
    """The frozen text encoder: a ``UMT5EncoderModel`` at its seeded random initialisation."""
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(vocab_size=len(build_mini_tokenizer()), **MINI_TEXT_ENCODER_CONFIG)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED_TEXT_ENCODER)
        return UMT5EncoderModel(config).eval()


def build_mini_vae():
    """An untrained ``AutoencoderKLWan`` of the mini size (seeded)."""
    import torch
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED_VAE)
        return AutoencoderKLWan(**MINI_VAE_CONFIG)


def mini_transformer_config(size: dict | None = None) -> dict:
    """Mini's transformer config, with the dimensions ``size`` names (:data:`TRANSFORMER_SIZE_KEYS`) changed
    (heads stay 64 wide: the FP4 kernels' head_dim)."""
    return {**MINI_TRANSFORMER_CONFIG, **{TRANSFORMER_SIZE_KEYS[k]: v for k, v in (size or {}).items()}}


def build_mini_transformer(seed: int = _SEED_TRANSFORMER, size: dict | None = None):
    """An untrained ``WanTransformer3DModel`` of :func:`mini_transformer_config` (seeded)."""
    import torch
    from diffusers import WanTransformer3DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return WanTransformer3DModel(**mini_transformer_config(size))


def build_mini_pipeline(transformer=None, vae=None):
    """A ``WanPipeline`` of mini components (untrained ones where none are given)."""
    from diffusers import WanPipeline

    from attnqat.pipelines.tiny import build_tiny_scheduler

    return WanPipeline(tokenizer=build_mini_tokenizer(), text_encoder=build_mini_text_encoder(),
                       vae=vae if vae is not None else build_mini_vae(),
                       scheduler=build_tiny_scheduler(MINI_FLOW_SHIFT),
                       transformer=transformer if transformer is not None else build_mini_transformer())


def save_pipeline_folder(pipe, folder: str | os.PathLike, *, transformer_dtype=None, vae_dtype=None,
                         text_encoder_dtype=None, check_size: bool = True,
                         max_folder_bytes: int = MAX_FOLDER_BYTES) -> Path:
    """Write ``pipe`` as a diffusers-format folder, atomically (a temporary folder, then one rename).

    Weights are stored small: the transformer and text encoder in bf16, the VAE in fp16 (it runs in
    fp32; loading upcasts). Safetensors files are sharded to at most 15 MiB. An existing ``folder`` is
    replaced only after the new one is complete, and only if it is itself a diffusers folder
    (``model_index.json``), never an unrelated directory. ``check_size`` enforces the shipped limits
    (:func:`check_folder_size`, the folder's total at most ``max_folder_bytes``).
    The ``*_dtype`` arguments override those storage dtypes (None: bf16, fp16, bf16).
    """
    import torch

    folder = Path(folder)
    if folder.exists() and not (folder / "model_index.json").is_file():
        raise FileExistsError(f"{folder} exists and is not a diffusers model folder; refusing to replace it")
    casts = {"transformer": transformer_dtype or torch.bfloat16, "vae": vae_dtype or torch.float16,
             "text_encoder": text_encoder_dtype or torch.bfloat16}
    originals = {name: next(getattr(pipe, name).parameters()).dtype for name in casts}

    def write(tmp: Path) -> None:
        try:
            for name, dtype in casts.items():
                torch.nn.Module.to(getattr(pipe, name), dtype)
            pipe.save_pretrained(str(tmp), safe_serialization=True, max_shard_size="14MB")
        finally:
            for name, dtype in originals.items():
                torch.nn.Module.to(getattr(pipe, name), dtype)

    def check(path: Path) -> int:
        return check_folder_size(path, max_folder_bytes)

    return replace_dir_atomically(folder, write, check if check_size else None)


def check_folder_size(folder: str | os.PathLike, max_folder_bytes: int = MAX_FOLDER_BYTES) -> int:
    """Total bytes of ``folder`` (the QAT weights beside the model, :data:`MINI_QAT_WEIGHTS`, not counted: they
    have their own limit); ValueError when a file or the total is over the shipped limits (the total's:
    ``max_folder_bytes``)."""
    qat = Path(folder) / MINI_QAT_WEIGHTS
    if qat.is_file() and qat.stat().st_size > MAX_QAT_WEIGHTS_BYTES:
        raise ValueError(f"{qat} is {qat.stat().st_size / 1e6:.1f} MB, over the {MAX_QAT_WEIGHTS_BYTES / 1e6:g} MB "
                         f"limit of shipped QAT weights")
    total = 0
    for p in Path(folder).rglob("*"):
        if p.is_file() and p != qat:
            size = p.stat().st_size
            if size > MAX_FILE_BYTES:
                raise ValueError(f"{p} is {size / 2 ** 20:.1f} MiB, over the {MAX_FILE_BYTES / 2 ** 20:.0f} MiB "
                                 f"limit of a shipped file")
            total += size
    if total > max_folder_bytes:
        raise ValueError(f"{folder} holds {total / 1e6:.1f} MB, over the {max_folder_bytes / 1e6:.0f} MB limit")
    return total

