"""attnqat: 4-bit (NVFP4) attention with quantization-aware training for video diffusion transformers."""
__version__ = "0.1.0"

__all__ = ["attention", "available_modes", "__version__"]


def _quiet_torchao_import() -> None:
    """Drop the warnings torchao's import logs where its build and this torch or diffusers differ. torchao is optional
    (``train.optimizer: adamw8bit`` uses its pure-PyTorch optimizer), but diffusers imports it whenever it is
    installed, so these lines would open every command's output, errors included (torchao 0.18 with torch 2.13 and
    diffusers 0.42: its CUDA extensions built for another Python or GPU, two Enum registrations torch deprecates,
    and diffusers' missing torchao quantization types). Only those records are dropped, by their loggers."""
    import logging

    dropped = {"torchao": ("Failed to load ",),
               "torch.utils._pytree": ("is an Enum subclass and is now natively supported by torch.compile",),
               "diffusers.quantizers.torchao.torchao_quantizer": ("Unable to import `torchao` Tensor objects",)}
    for name, texts in dropped.items():
        logging.getLogger(name).addFilter(
            lambda record, texts=texts: not any(t in str(record.msg) for t in texts))


_quiet_torchao_import()


def __getattr__(name: str):
    # attention and available_modes load attnqat.kernels (torch, Triton) on first use, so that
    # `import attnqat` and `attnqat --help` stay fast.
    if name in ("attention", "available_modes"):
        from . import kernels

        return getattr(kernels, name)
    raise AttributeError(f"module 'attnqat' has no attribute {name!r}")
