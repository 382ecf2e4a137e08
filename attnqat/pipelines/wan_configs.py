"""Wan 2.1 text-to-video transformer configs: one builder for the arguments of ``WanTransformer3DModel``, and the
published models' (each model's ``transformer/config.json`` on the hub), for building them in code with random
weights (benchmarks at their real sizes, config checks without a downloaded model). The ``tiny`` and ``mini``
models are built with the same builder."""
from __future__ import annotations

__all__ = ["wan_transformer_config", "WAN21_1_3B_TRANSFORMER_CONFIG", "WAN21_14B_TRANSFORMER_CONFIG"]


def wan_transformer_config(*, num_attention_heads: int, attention_head_dim: int, text_dim: int, freq_dim: int,
                           ffn_dim: int, num_layers: int) -> dict:
    """The arguments of ``WanTransformer3DModel`` for a Wan 2.1 text-to-video transformer of these sizes; the rest
    is Wan 2.1's: 1x2x2 patches of 16 latent channels (the VAE's z_dim), RMSNorm of Q and K across heads, a
    normed cross-attention, no image conditioning."""
    return dict(patch_size=(1, 2, 2), num_attention_heads=num_attention_heads, attention_head_dim=attention_head_dim,
                in_channels=16, out_channels=16, text_dim=text_dim, freq_dim=freq_dim, ffn_dim=ffn_dim,
                num_layers=num_layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024)


#: Wan-AI/Wan2.1-T2V-1.3B-Diffusers: 12 heads x 128 = hidden 1536, ffn 8960, 30 blocks.
WAN21_1_3B_TRANSFORMER_CONFIG = wan_transformer_config(num_attention_heads=12, attention_head_dim=128, text_dim=4096,
                                                       freq_dim=256, ffn_dim=8960, num_layers=30)
#: Wan-AI/Wan2.1-T2V-14B-Diffusers: 40 heads x 128 = hidden 5120, ffn 13824, 40 blocks.
WAN21_14B_TRANSFORMER_CONFIG = wan_transformer_config(num_attention_heads=40, attention_head_dim=128, text_dim=4096,
                                                      freq_dim=256, ffn_dim=13824, num_layers=40)
