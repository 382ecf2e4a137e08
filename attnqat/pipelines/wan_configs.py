"""The published Wan 2.1 text-to-video transformers' configs, for building them in code with random weights
(benchmarks at their real sizes, config checks without a downloaded model): the arguments of
``WanTransformer3DModel`` in each model's ``transformer/config.json`` on the hub."""
from __future__ import annotations

__all__ = ["WAN21_1_3B_TRANSFORMER_CONFIG", "WAN21_14B_TRANSFORMER_CONFIG"]

#: Wan-AI/Wan2.1-T2V-1.3B-Diffusers: 12 heads x 128 = hidden 1536, ffn 8960, 30 blocks.
WAN21_1_3B_TRANSFORMER_CONFIG = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024,
)
#: Wan-AI/Wan2.1-T2V-14B-Diffusers: 40 heads x 128 = hidden 5120, ffn 13824, 40 blocks.
WAN21_14B_TRANSFORMER_CONFIG = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024,
)
