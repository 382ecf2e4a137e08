"""Fused Triton attention kernels (Attn-QAT, NVFP4 baselines, SageBwd) and their references."""
from .api import Mode, attention, available_modes, backend_info, register_mode
from .nvfp4 import dequantize_nvfp4, fake_quant_nvfp4, quantize_nvfp4
from .sagebwd import sagebwd_attention

__all__ = [
    "Mode", "attention", "available_modes", "backend_info", "register_mode",
    "fake_quant_nvfp4", "quantize_nvfp4", "dequantize_nvfp4",
    "sagebwd_attention",
]
