import os

import pytest
import torch

# Kernels are compiled for CUDA; without a GPU the suite runs them in Triton's CPU interpreter.
# Must be set before triton.jit decorates anything, i.e. before attnqat is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def poison(monkeypatch):
    """Make every float torch.empty / empty_like return NaN-filled memory, so a kernel that leaves an
    output element unwritten fails the comparison instead of passing on lucky zeros."""
    empty, empty_like = torch.empty, torch.empty_like

    def _fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: _fill(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: _fill(empty_like(*a, **kw)))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (NaN if either holds NaN)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def cos_sim(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()
