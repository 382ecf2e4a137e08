"""The offline ``tiny`` model: a Wan 2.1-architecture text-to-video pipeline built in code.

Every component has Wan 2.1's classes and wiring, only much smaller, and **random weights** from
fixed seeds (nothing is downloaded, nothing is pretrained, so its videos are noise-like):

- tokenizer: a byte-level ``PreTrainedTokenizerFast`` built from a ``tokenizers`` model in memory
  (every UTF-8 byte is one token, ``</s>`` appended like T5's);
- text encoder: ``UMT5EncoderModel`` (2 layers, d_model 32);
- VAE: ``AutoencoderKLWan`` (base_dim 8, z_dim 16, the real 4x temporal / 8x spatial compression);
- transformer: ``WanTransformer3DModel`` with 2 heads x head_dim 64 (so NVFP4's 16-element blocks
  and the FP4 kernels' head_dim constraint apply), 2 blocks;
- scheduler: ``UniPCMultistepScheduler`` in flow-prediction mode, as Wan 2.1 ships it.

It exists so that the whole pipeline (attention patching, ``attnqat generate``, QAT training loops,
tests) runs on a laptop CPU in seconds.
"""
from __future__ import annotations

import torch

from .wan_configs import wan_transformer_config

#: Printed by the CLI and repeated in the README: the tiny model is not a video model.
TINY_NOTICE = ("model 'tiny' has RANDOM weights (a Wan 2.1-architecture pipeline built in code, for "
               "tests and offline smoke runs): its video is noise-like, not an image of the prompt")

# The sizes, in one place. head_dim 64 is the smallest head size the FP4 kernels take.
TINY_TEXT_DIM = 32
TINY_TRANSFORMER_CONFIG = wan_transformer_config(
    num_attention_heads=2,
    attention_head_dim=64,
    text_dim=TINY_TEXT_DIM,    # = the text encoder's d_model
    freq_dim=64,
    ffn_dim=256,
    num_layers=2,
)
TINY_VAE_CONFIG = dict(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                       temperal_downsample=[False, True, True])
TINY_FLOW_SHIFT = 3.0  # Wan 2.1's 480p value

# Seeds, one per component, so that building one component never depends on building another.
_SEED_TEXT_ENCODER, _SEED_VAE, _SEED_TRANSFORMER = 0, 1, 2


def _cast(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast as ``from_pretrained(torch_dtype=dtype)`` would: modules the class lists in
    ``_keep_in_fp32_modules`` (Wan's RoPE, time embedder, norms, modulation tables) stay float32."""
    if dtype == torch.float32:
        return model
    torch.nn.Module.to(model, dtype)  # plain Module.to: diffusers' override warns about exactly this cast
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for name, module in model.named_modules():
        if any(part in keep for part in name.split(".")):
            module.float()
    for name, param in model.named_parameters(recurse=True):
        if any(part in keep for part in name.split(".")):
            param.data = param.data.float()
    return model


def build_tiny_tokenizer():
    """A byte-level tokenizer built in memory (no files, no network), T5-style specials.

    Ids: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, then one id per byte (259 in all).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=512)


def build_tiny_text_encoder(dtype: torch.dtype = torch.float32):
    """A 2-layer ``UMT5EncoderModel`` with random weights (seed fixed)."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(vocab_size=len(build_tiny_tokenizer()), d_model=TINY_TEXT_DIM, d_kv=8, d_ff=64,
                        num_layers=2, num_heads=4, relative_attention_num_buckets=8,
                        relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
                        dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED_TEXT_ENCODER)
        model = UMT5EncoderModel(config)
    return _cast(model, dtype).eval()


def build_tiny_vae(dtype: torch.dtype = torch.float32):
    """A tiny ``AutoencoderKLWan`` (Wan 2.1's 4x temporal, 8x spatial compression) with random weights."""
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED_VAE)
        vae = AutoencoderKLWan(**TINY_VAE_CONFIG)
    return _cast(vae, dtype).eval()


def build_tiny_transformer(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
    """A 2-block ``WanTransformer3DModel`` with 2 heads of dim 64 and random weights (seed fixed).

    The same call always returns the same weights, so a QAT checkpoint trained on it loads back
    into a fresh one.
    """
    from diffusers import WanTransformer3DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED_TRANSFORMER)
        model = WanTransformer3DModel(**TINY_TRANSFORMER_CONFIG)
    return _cast(model, dtype).to(device).eval()


def build_tiny_scheduler(flow_shift: float = TINY_FLOW_SHIFT):
    """Wan 2.1's scheduler: UniPC multistep in flow-prediction mode with shifted flow sigmas."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                   num_train_timesteps=1000, flow_shift=flow_shift)


def build_tiny_pipeline(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                        flow_shift: float = TINY_FLOW_SHIFT):
    """The offline ``tiny`` ``WanPipeline``: Wan 2.1's architecture, tiny sizes, RANDOM weights.

    Arguments:
        dtype: dtype of the transformer and text encoder (the VAE stays float32, as diffusers
            recommends for Wan's VAE).
        device: where to put the models.
        flow_shift: the flow-matching shift of the UniPC scheduler.
    Return:
        a ``diffusers.WanPipeline``; deterministic: two calls build identical weights.
    """
    from diffusers import WanPipeline

    pipe = WanPipeline(tokenizer=build_tiny_tokenizer(), text_encoder=build_tiny_text_encoder(dtype),
                       vae=build_tiny_vae(torch.float32), scheduler=build_tiny_scheduler(flow_shift),
                       transformer=build_tiny_transformer(dtype))
    return pipe.to(device)
