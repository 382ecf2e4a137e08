"""Cross-attention over a prompt's tokens and one stand-in for its padding (``data.corpus.compact_text``).

WanPipeline pads every prompt's embeddings with zeros to 512 tokens (``max_sequence_length``), and Wan's text
embedder maps each zero row to the same vector, so all the padded keys and values of a cross-attention are one
row repeated. Attention over m equal keys is attention over one of them with its logit raised by ln m:

    sum_j exp(s_j) v_j = sum_{j real} exp(s_j) v_j + m exp(s_pad) v_pad
                       = sum_{j real} exp(s_j) v_j + exp(s_pad + ln m) v_pad     (and the same for the sum of weights)

So a training step may keep the first L rows of the prompt embeddings, every caption's tokens and at least one
padded row, and let the last of them stand for all ``text_len - L + 1`` padded rows: the same attention in exact
arithmetic over L keys instead of 512. mini's captions are at most a few dozen tokens, and on an H200 its
33x256x256 training step spent 3.4 of 42 ms in cross-attention over 512 keys (docs/benchmarks.md).

:class:`CompactTextProcessor` is the cross-attention's processor: with ``text_len`` keys it is diffusers' own;
with fewer it adds ln(count) to the last key's logit and computes the attention in float32 outside autocast, as
plain products and a softmax (in bf16, ln 489 = 6.19 would round by up to 0.016, a 1.6% error in the padding's
weight). :func:`install` sets it on every block's ``attn2``.
The corpus source (:mod:`.corpus_source`) cuts the embeddings and refuses a caption too long for L.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from attnqat.pipelines.processor import qkv_projections


class CompactTextProcessor(WanAttnProcessor):
    """Wan's text cross-attention whose last key may stand for the prompt's padding (module docstring).

    Arguments:
        text_len: the padded length of the prompt embeddings the model was trained on (WanPipeline: 512).
    """

    def __init__(self, text_len: int):
        super().__init__()
        self.text_len = text_len

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb=None) -> torch.Tensor:
        keys = encoder_hidden_states.shape[1] if encoder_hidden_states is not None else self.text_len
        if keys >= self.text_len or attention_mask is not None:  # whole embeddings: diffusers' processor as it is
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        query, key, value = qkv_projections(attn, hidden_states, encoder_hidden_states)
        # (B, L, H, D) -> (B, H, L, D), as diffusers' processor normalizes and splits them
        query, key, value = (t.unflatten(2, (attn.heads, -1)).transpose(1, 2)
                             for t in (attn.norm_q(query), attn.norm_k(key), value))
        pads = self.text_len - keys + 1  # the padded rows the last key stands for
        bias = F.pad(torch.zeros(1, 1, 1, keys - 1, device=query.device), (0, 1), value=math.log(pads))
        # Plain float32 products and softmax, not SDPA: over a few dozen keys they are a few small kernels that
        # the compiler fuses, while SDPA's float32 path (memory-efficient attention) cost more than bf16 cuDNN
        # over all 512 keys (H200, mini at 33x256x256: 45.1 against 42.0 ms a step).
        with torch.autocast(query.device.type, enabled=False):
            logits = torch.matmul(query.float(), key.float().transpose(-1, -2)) * query.shape[-1] ** -0.5 + bias
            out = torch.matmul(logits.softmax(dim=-1), value.float())
        out = out.transpose(1, 2).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def install(transformer: torch.nn.Module, text_len: int) -> None:
    """Every block's text cross-attention (``attn2``) through :class:`CompactTextProcessor`; refused for I2V
    models, whose ``attn2`` also attends to image tokens."""
    for i, block in enumerate(transformer.blocks):
        if block.attn2.add_k_proj is not None:
            raise ValueError(f"data.corpus.compact_text: block {i}'s cross-attention also attends to image tokens "
                             f"(an image-to-video model); it runs only for text-to-video transformers")
        block.attn2.set_processor(CompactTextProcessor(text_len))
