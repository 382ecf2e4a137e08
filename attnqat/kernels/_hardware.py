"""What the GPU and the installed Triton can do: the probes behind the kernels' hardware-dependent flags.

    fp8_cast(device)                 round to e4m3 with the hardware cast (sm_89+), else integer arithmetic
    fp4_mma_arch(device)             sm_<arch> of a GPU with block-scaled FP4 MMAs (sm_100/103, sm_120/121)
    compile_for(kernel, arch, ...)   compile a ``@triton.jit`` (or ``@gluon.jit``) kernel for sm_<arch>, no GPU
    first_that_compiles(build, ..)   the first kernel form that this Triton compiles (its failures hushed)

Nothing here knows a kernel, so every kernel module can import it: ``attn_qat.native_fp4`` puts the last
three together for its forward (which form of the NVFP4 ``dot_scaled`` forward this Triton lowers).
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterable

import torch
import triton

from ._common import interpreting

NATIVE_FP4_ARCHS = (10, 12)  # compute capability majors with block-scaled FP4 MMAs: sm_100/103, sm_120/121


def fp8_cast(device: torch.device) -> bool:
    """Whether the kernels may round to e4m3 with the hardware cast (sm_89+), else with integer arithmetic (as on
    Ampere; a GPU test forces that path by patching this probe and compares the two)."""
    if interpreting() or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp4_mma_arch(device: torch.device) -> int:
    """sm_<arch> (e.g. 100, 120) when ``device`` is a GPU with block-scaled FP4 MMAs, else 0; also 0 under the
    interpreter and with ATTNQAT_NATIVE_FP4=0 (keep the bf16 emulation: a user's switch, docs/environment.md)."""
    if interpreting() or device.type != "cuda" or os.environ.get("ATTNQAT_NATIVE_FP4", "1") == "0":
        return 0
    cap = torch.cuda.get_device_capability(device)
    return cap[0] * 10 + cap[1] if cap[0] in NATIVE_FP4_ARCHS else 0


def compile_for(kernel, arch: int, *, types: dict[str, str], constexprs: dict, aligned: Iterable[str],
                num_warps: int, num_stages: int):
    """Compile ``kernel`` (a ``@triton.jit`` or ``@gluon.jit`` function) for sm_<arch> without a GPU; returns
    Triton's compiled kernel (``.asm["ptx"]``, ``.metadata.shared`` etc.).

    ``types``: Triton type of each argument that is not an i32 (``"*bf16"``, ``"fp32"``, ...); ``constexprs``:
    the value of each constexpr argument (one left out takes its default, as at a launch); ``aligned``: pointer arguments to declare 16-byte aligned, as torch
    allocates them and a launch specialises (without it loads are not vectorised, so not pipelined, and the
    compile is not the one a GPU runs)."""
    from triton.backends.compiler import GPUTarget

    names = kernel.arg_names
    constexprs = {**{p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}, **constexprs}
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = triton.compiler.ASTSource
    if kernel.is_gluon():  # Gluon kernels are already TTGIR: their own source class skips Triton's layout passes
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn=kernel, signature=sig, attrs=attrs,
                 constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def first_that_compiles(build: Callable[[int], object], forms: Iterable[int]) -> int:
    """The first of ``forms`` for which ``build(form)`` (a compile) succeeds, else 0. A form that fails
    prints MLIR's reproducer on file descriptor 2: not the user's concern, so it goes to /dev/null."""
    for form in forms:
        try:
            with _stderr_to_devnull():
                build(form)
        except Exception:  # this form does not lower here: try the next
            continue
        return form
    return 0


@contextlib.contextmanager
def _stderr_to_devnull():
    """Point file descriptor 2 (where Triton's C++ passes print) at /dev/null for the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
