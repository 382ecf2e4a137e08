"""attnqat: 4-bit (NVFP4) attention with quantization-aware training for video diffusion transformers."""
__version__ = "0.1.0"

__all__ = ["attention", "available_modes", "__version__"]


def __getattr__(name: str):
    # attention and available_modes load attnqat.kernels (torch, Triton) on first use, so that
    # `import attnqat` and `attnqat --help` stay fast.
    if name in ("attention", "available_modes"):
        from . import kernels

        return getattr(kernels, name)
    raise AttributeError(f"module 'attnqat' has no attribute {name!r}")
