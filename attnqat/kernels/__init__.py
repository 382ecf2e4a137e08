"""Fused Triton attention kernels (Attn-QAT, NVFP4 baselines, SageBwd) and their references."""
from ._common import saved_tensors_recomputed
from .api import REFERENCE_MODE, Mode, attention, available_modes, backend_info, mode_of, reference_first, register_mode
from .nvfp4 import dequantize_nvfp4, fake_quant_nvfp4, quantize_nvfp4
from .rotation import QK_ROTATIONS, describe_qk_options, hadamard_matrix
from .sagebwd import sagebwd_attention

__all__ = [
    "Mode", "REFERENCE_MODE", "attention", "available_modes", "backend_info", "mode_of", "reference_first",
    "register_mode", "fake_quant_nvfp4", "quantize_nvfp4", "dequantize_nvfp4",
    "sagebwd_attention", "QK_ROTATIONS", "describe_qk_options", "hadamard_matrix", "saved_tensors_recomputed",
]
