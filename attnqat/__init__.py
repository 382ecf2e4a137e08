"""attnqat: 4-bit (NVFP4) attention with quantization-aware training for video diffusion transformers."""
__version__ = "0.1.0"

from .kernels import attention, available_modes  # noqa: E402

__all__ = ["attention", "available_modes", "__version__"]
