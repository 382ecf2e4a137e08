"""SageBwd's int8 backward in Gluon for sm_90 (attnqat/kernels/hopper_sagebwd.py): its dK/dV and dQ kernels compile
for sm_90a on any machine whose Triton has Gluon's Hopper API, with int8 wgmma (the A operands P^T, dS^T, dS from
registers) and a bf16 one for dP; sagebwd.gluon_backward decides when sagebwd_backward runs them; on an H100/H200
they give the Triton kernels' O, dQ, dK, dV bit for bit (ATTNQAT_GLUON=0 runs those), ragged, causal, Lq != Lk, NaN
included."""
import re

import pytest
import torch

from attnqat.kernels import hopper_gluon, hopper_sagebwd
from attnqat.kernels import sagebwd as S
from attnqat.kernels.formats import SAGEBWD_K_BLOCK, SAGEBWD_Q_BLOCK
from conftest import compiled_outside_interpreter
from test_hopper_gluon import COMPILE_HEAD, H100_SHARED_BYTES
from test_sagebwd import _inputs, _run_kernel, poison  # noqa: F401 - poison: a fixture (S._empty fills NaN)

COMPILE = COMPILE_HEAD + """
import torch
from attnqat.kernels import hopper_sagebwd
for head_dim, causal in ((64, False), (128, True)):
    for name, compiled in hopper_sagebwd.compile_backward(head_dim, causal).items():
        record(f"{head_dim},{name}", compiled)
for name, compiled in hopper_sagebwd.compile_backward(128, True, torch.float16).items():
    record(f"128,{name},fp16", compiled)
print(json.dumps(out))
"""

WGMMA = r"wgmma\.mma_async\.sync\.aligned\."
ACC = r" \{[^}]*\}, "  # the accumulator's registers
SMEM_A = r"%rd\d+, %rd\d+"  # A and B from shared memory (64-bit descriptors)
REG_A = r"\{%r\d+,%r\d+,%r\d+,%r\d+\}, %rd\d+"  # A from four registers (16 int8 a thread), B from shared memory


def _count(pattern, ptx):
    return len(re.findall(pattern, ptx))


@pytest.fixture(scope="module")
def compiled():
    """Both kernels compiled for sm_90a at head_dim 64 (non-causal) and 128 (causal), and at 128 causal for fp16: PTX,
    shared memory, ptxas's resource usage, SASS counts. A compile only, outside the interpreter, in a subprocess, once
    for the module's tests."""
    if hopper_gluon._MISSING:
        pytest.skip(f"cannot compile the Gluon sm_90 SageBwd backward here: {hopper_gluon._MISSING}")
    return compiled_outside_interpreter(COMPILE, timeout=300)


def test_backward_compiles_for_sm90a(compiled):
    """Both kernels are Hopper kernels: sm_90a, 4-d TMA loads completing on mbarriers, a one-warp load partition at 24
    registers and consumer warpgroups at 240 (setmaxnreg), within H100's shared memory; the only shared-memory stores
    and loads are warp_specialize's own few (P^T, dS^T, dS reach wgmma from registers, and dQ, dK, dV go out by
    global stores from the accumulators). No local memory. Stack: ptxas spills a few of the dK/dV kernel's registers at
    head_dim 128 (Triton 3.9: 64 bytes causal, 176 not; 3.6: 296 and 272), none at 64 nor in dQ."""
    assert set(compiled) == {"64,dkdv", "64,dq", "128,dkdv", "128,dq", "128,dkdv,fp16", "128,dq,fp16"}
    for key, kernel in compiled.items():
        ptx = kernel["ptx"]
        assert ".target sm_90a" in ptx, key
        # Triton 3.6 writes the destination as shared::cluster, 3.9 as shared::cta
        assert re.search(r"cp\.async\.bulk\.tensor\.4d\.shared::\w+\.global\.mbarrier::complete_tx::bytes", ptx), key
        assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx), key
        assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;", ptx), key
        assert kernel["shared"] <= H100_SHARED_BYTES, key
        # the barriers' set-up and warp_specialize's hand-off: 3 stores and 2 loads with 3.9, 2 and 1 with 3.6; dK/dV
        # adds the load partition's two stores of a query tile's lse and D and each consumer's reads of them (16
        # values a thread each, in 8-byte loads): 2 x 2 x 8
        stores, loads = (5, 34) if "dkdv" in key else (3, 2)
        assert ptx.count("st.shared") <= stores and ptx.count("ld.shared") <= loads, key
        match = re.fullmatch(r"REG:\d+ STACK:(\d+) SHARED:\d+ LOCAL:0", kernel["usage"])
        assert match, (key, kernel["usage"])
        stack = int(match[1])
        if key.startswith("128,dkdv"):
            assert stack <= 320, (key, kernel["usage"])
        else:
            assert stack == 0, (key, kernel["usage"])


# Per kernel and consumer warpgroup: (N of the int8 product with a register A operand at head_dim d, its
# instructions, full wgmma waits), as the test's docstring derives them.
PRODUCTS = {"dkdv": (lambda d: d // 2, 2 * 2 * 2, 6), "dq": (lambda d: d, 2, 2)}


@pytest.mark.parametrize("name", ["dkdv", "dq"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernels_run_int8_wgmma_with_register_operands(compiled, head_dim, name):
    """Each kernel, per consumer warpgroup (two of them) and ring tile of 64 rows:

    dK/dV: S^T = psi(K) psi(Q)^T as int8 wgmma with both operands in shared memory (N = 64 queries, K = head_dim in
    steps of 32: head_dim / 32 instructions); dP^T = V dO^T as bf16 wgmma (head_dim / 16 steps of 16);
    dV += psi(P^T) psi(dO) and dK += psi(dS^T) psi(Q) as int8 wgmma with the A operand in registers, each in two column
    halves of N = head_dim / 2 over K = 64 queries (2 steps of 32): 2 products x 2 halves x 2 = 8 instructions. One
    full wgmma wait each for S^T, dP^T and the four half products: 6.

    dQ: S = psi(Q) psi(K)^T as int8 wgmma from shared memory (N = 64 keys, head_dim / 32 steps), dP = dO V^T as bf16
    wgmma (head_dim / 16 steps), dQ += psi(dS) psi(K) with dS from registers (N = head_dim, K = 64 keys: 2 steps).
    Two full waits: dP's and the product's (S is waited on with dP still in flight).

    Nothing else is a wgmma; the SASS holds as many HGMMA and IGMMA instructions and no more full waits (ptxas
    serialised none). psi's int8 rounding is trunc(y + copysign(0.5 - 2^-25, y)): a copysign, an add and the truncating
    conversion per element (32 a thread per quantized 64 x 64 tile: two tiles in dK/dV, one in dQ), no floor; the row
    scale comes from a NaN-propagating row max."""
    kernel = compiled[f"{head_dim},{name}"]
    ptx = kernel["ptx"]
    grad_n, grad_instructions, full_waits = PRODUCTS[name]
    scores = _count(WGMMA + r"m64n64k32\.s32\.s8\.s8" + ACC + SMEM_A + r", [^;]*;", ptx)
    dp = _count(WGMMA + r"m64n64k16\.f32\.bf16\.bf16" + ACC + SMEM_A + r", [^;]*, 0, 0;", ptx)
    grads = _count(WGMMA + rf"m64n{grad_n(head_dim)}k32\.s32\.s8\.s8" + ACC + REG_A + r", [^;]*;", ptx)
    assert (scores, dp, grads) == (2 * head_dim // 32, 2 * head_dim // 16, 2 * grad_instructions)
    assert ptx.count("wgmma.mma_async") == scores + dp + grads
    assert kernel["hgmma"] == dp and kernel["igmma"] == scores + grads
    assert kernel["full_waits"] == 2 * full_waits
    tiles = 2 if name == "dkdv" else 1
    assert ptx.count("cvt.rzi.s16.f32") == 2 * tiles * 32 and "copysign.f32" in ptx
    assert "cvt.rmi" not in ptx
    assert "max.NaN.f32" in ptx


def test_fp16_kernels_run_dp_in_fp16(compiled):
    """With fp16 dO and V the dP wgmma is an f16 one and nothing else changes: the int8 products and the SASS
    counts are the bf16 kernels'."""
    for name in ("dkdv", "dq"):
        bf16, fp16 = compiled[f"128,{name}"], compiled[f"128,{name},fp16"]
        assert _count(WGMMA + r"m64n64k16\.f32\.f16\.f16" + ACC + SMEM_A, fp16["ptx"]) == 2 * 128 // 16
        assert "bf16.bf16" not in fp16["ptx"]
        int8 = re.compile(WGMMA + r"m64n\d+k32\.s32\.s8\.s8")
        assert int8.findall(fp16["ptx"]) == int8.findall(bf16["ptx"])
        for count in ("hgmma", "igmma", "full_waits"):
            assert fp16[count] == bf16[count], (name, count)


# --- When sagebwd_backward runs them: sagebwd.gluon_backward -------------------------------------------------------

PINS = ("ATTNQAT_SAGEBWD_FWD_CONFIG", "ATTNQAT_SAGEBWD_DKDV_CONFIG", "ATTNQAT_SAGEBWD_DQ_CONFIG")
COVERS = "the Gluon backward covers bwd='int8' with K-major copies, no smooth_q, head_dim 64 or 128"


@pytest.fixture
def runnable(monkeypatch):
    """A machine where the Gluon kernels can run (hopper_gluon.available says so), without any of the environment
    variables that choose the Triton kernels."""
    monkeypatch.setattr(hopper_gluon, "available", lambda device=None: (True, "Gluon sm_90 forward available"))
    for name in (hopper_gluon.GLUON_ENV, *PINS):
        monkeypatch.delenv(name, raising=False)
    return torch.device("cuda")


GOOD = dict(head_dim=128, bwd="int8", km=True, smooth_q=False)


def test_gluon_backward_covers_the_int8_backward_only(runnable):
    """Where Gluon runs, the SPEC's int8 backward on K-major copies without Q-smoothing at head_dim 64 and 128 takes
    the Gluon kernels; any other bwd, row-major copies, smooth_q, or another head_dim the Triton ones, with a reason
    that names what the Gluon kernels cover."""
    assert S.gluon_backward(runnable, **GOOD) == (True, "Gluon sm_90 forward available")
    assert S.gluon_backward(runnable, **{**GOOD, "head_dim": 64})[0]
    for change in ({"bwd": "fp8"}, {"bwd": "bf16"}, {"km": False}, {"smooth_q": True}, {"head_dim": 96},
                   {"head_dim": 32}):
        assert S.gluon_backward(runnable, **{**GOOD, **change}) == (False, COVERS), change


def test_gluon_backward_env_chooses_the_triton_kernels(runnable, monkeypatch):
    """ATTNQAT_GLUON=0, or a pinned dK/dV or dQ launch config (which is the Triton kernels'), turns the Gluon
    backward off and says so; a pinned forward config does not (the forward is Triton's either way), nor does
    ATTNQAT_GLUON=1."""
    monkeypatch.setenv(hopper_gluon.GLUON_ENV, "1")
    assert S.gluon_backward(runnable, **GOOD)[0]
    monkeypatch.setenv(hopper_gluon.GLUON_ENV, "0")
    assert S.gluon_backward(runnable, **GOOD) == (False, "ATTNQAT_GLUON=0")
    monkeypatch.delenv(hopper_gluon.GLUON_ENV)
    monkeypatch.setenv("ATTNQAT_SAGEBWD_FWD_CONFIG", "64,64,4,2")
    assert S.gluon_backward(runnable, **GOOD)[0]
    monkeypatch.setenv("ATTNQAT_SAGEBWD_DKDV_CONFIG", "64,128,8,2")
    assert S.gluon_backward(runnable, **GOOD) == (
        False, "ATTNQAT_SAGEBWD_DKDV_CONFIG pin the Triton kernels' launch config")
    monkeypatch.setenv("ATTNQAT_SAGEBWD_DQ_CONFIG", "128,64,8,2")
    assert S.gluon_backward(runnable, **GOOD) == (
        False, "ATTNQAT_SAGEBWD_DKDV_CONFIG and ATTNQAT_SAGEBWD_DQ_CONFIG pin the Triton kernels' launch config")
    monkeypatch.delenv("ATTNQAT_SAGEBWD_DKDV_CONFIG")
    assert S.gluon_backward(runnable, **GOOD) == (
        False, "ATTNQAT_SAGEBWD_DQ_CONFIG pin the Triton kernels' launch config")


def test_gluon_backward_off_where_gluon_cannot_run(monkeypatch):
    """On a CPU tensor (here: the interpreter, or a CPU device beside a GPU) the answer is hopper_gluon.available's
    no, with its reason."""
    for name in (hopper_gluon.GLUON_ENV, *PINS):
        monkeypatch.delenv(name, raising=False)
    cpu = torch.device("cpu")
    ok, why = S.gluon_backward(cpu, **GOOD)
    assert not ok and why == hopper_gluon.available(cpu)[1]
    if hopper_gluon._MISSING:
        assert why == hopper_gluon._MISSING
    elif S.interpreting():
        assert "TRITON_INTERPRET" in why
    else:
        assert why == "device cpu is not a CUDA GPU"


class _NotLaunched:
    """Stands in for a Triton kernel that must not run."""

    def __init__(self, name):
        self.name = name

    def __getitem__(self, grid):
        raise AssertionError(f"{self.name} launched")


def test_backward_hands_its_operands_to_the_gluon_kernels(runnable, monkeypatch, poison):
    """Where gluon_backward says yes, sagebwd_backward calls hopper_sagebwd.sagebwd_dkdv_dq once, with what its
    docstring asks for (dO and V contiguous, the int8 codes row-major and K-major, the block scales of 128 query and
    64 key rows, lse and D per query, contiguous outputs), returns what it wrote, and launches neither Triton gradient
    kernel. Run in the interpreter with the Gluon launch replaced by a recorder (the kernels need an H100)."""
    b, h, lq, lk, d = 1, 2, 80, 144, 64
    q, k, v, do = _inputs(b, h, lq, lk, d, torch.bfloat16, "cpu", k_offset=1.0)
    monkeypatch.setattr(hopper_gluon, "available", lambda device=None: (True, "stand-in"))
    monkeypatch.setattr(S, "gluon_forward", lambda *args: (False, "the Triton forward: this test is the backward's"))
    monkeypatch.setattr(S, "_attn_bwd_dkdv", _NotLaunched("_attn_bwd_dkdv"))
    monkeypatch.setattr(S, "_attn_bwd_dq", _NotLaunched("_attn_bwd_dq"))
    calls = []

    def record(do_, q8, qt, k8, kt, v_, sq, sk, dot, sdo, lse, delta, dq, dk, dv, *, sm_scale, causal, q_block,
               k_block):
        calls.append(dict(sm_scale=sm_scale, causal=causal, q_block=q_block, k_block=k_block))
        assert do_.is_contiguous() and v_.is_contiguous() and torch.equal(v_, v)
        for x8, t8, n in ((q8, qt, lq), (k8, kt, lk)):
            assert x8.dtype == t8.dtype == torch.int8 and x8.shape == (b, h, n, d) and x8.is_contiguous()
            assert t8.shape == (b, h, d, n) and t8.stride(-1) == 1 and torch.equal(t8, x8.transpose(-1, -2))
        assert dot.dtype == torch.int8 and dot.shape == (b, h, d, lq) and dot.stride(-1) == 1
        nq, nk = -(-lq // SAGEBWD_Q_BLOCK), -(-lk // SAGEBWD_K_BLOCK)
        assert sq.shape == sdo.shape == (b, h, nq) and sk.shape == (b, h, nk)
        assert lse.shape == delta.shape == (b, h, lq) and torch.isfinite(delta).all()
        for g, fill in ((dq, 1.0), (dk, 2.0), (dv, 3.0)):
            assert g.is_contiguous()
            g.fill_(fill)

    monkeypatch.setattr(hopper_sagebwd, "sagebwd_dkdv_dq", record)
    _, dq, dk, dv = _run_kernel(q, k, v, do, causal=True)
    assert calls == [dict(sm_scale=d ** -0.5, causal=True, q_block=SAGEBWD_Q_BLOCK, k_block=SAGEBWD_K_BLOCK)]
    assert (dq == 1).all() and (dk == 2).all() and (dv == 3).all()


# --- On an H100/H200: the Triton kernels' gradients, bit for bit ---------------------------------------------------


def _gluon_and_triton(monkeypatch, q, k, v, do, causal):
    """O, dQ, dK, dV of sagebwd_attention with the Gluon backward (asserted chosen, and called once) and with the
    Triton one (ATTNQAT_GLUON=0)."""
    ok, why = hopper_gluon.available()
    if not ok:
        pytest.skip(why)
    for name in (*PINS, "ATTNQAT_SAGEBWD_KMAJOR"):
        monkeypatch.delenv(name, raising=False)
    calls = []
    real = hopper_sagebwd.sagebwd_dkdv_dq
    monkeypatch.setattr(hopper_sagebwd, "sagebwd_dkdv_dq", lambda *a, **kw: calls.append(kw["causal"]) or
                        real(*a, **kw))
    monkeypatch.setenv(hopper_gluon.GLUON_ENV, "1")
    chosen = S.gluon_backward(q.device, q.shape[-1], "int8", S.kmajor(), False)
    assert chosen == (True, "Gluon sm_90 forward available"), chosen  # else this compares Triton with Triton
    gluon = _run_kernel(q, k, v, do, causal=causal)
    assert calls == [causal]
    monkeypatch.setenv(hopper_gluon.GLUON_ENV, "0")
    triton_path = _run_kernel(q, k, v, do, causal=causal)
    assert calls == [causal]
    return gluon, triton_path


def _assert_equal(gluon, triton_path, like):
    for name, g, t, x in zip(("o", "dq", "dk", "dv"), gluon, triton_path, like):
        assert g.shape == t.shape == x.shape and g.dtype == t.dtype == x.dtype, name
        assert torch.isfinite(t).all(), name
        assert torch.equal(g, t), (name, (g != t).sum().item())


# (B, H, Lq, Lk, head_dim, causal, dtype): ragged lengths, Lq != Lk both ways, both head dims, batch > 1
GPU_SHAPES = [
    (1, 2, 256, 256, 128, False, torch.bfloat16),
    (1, 2, 256, 256, 128, True, torch.bfloat16),
    (2, 3, 333, 200, 128, False, torch.bfloat16),  # Lq > Lk, both ragged
    (2, 3, 200, 333, 128, True, torch.bfloat16),   # Lq < Lk causal: keys past Lq get zero gradients
    (1, 2, 190, 300, 64, False, torch.bfloat16),
    (1, 2, 300, 190, 64, True, torch.bfloat16),    # Lq > Lk causal: queries past Lk see every key
    (2, 2, 129, 129, 64, True, torch.bfloat16),    # one row past a 128-row program
    (1, 4, 1000, 1000, 128, True, torch.bfloat16),
    (2, 3, 333, 200, 128, True, torch.float16),    # fp16 dO, V: dP in f16
    (1, 2, 190, 300, 64, False, torch.float16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("b,h,lq,lk,d,causal,dtype", GPU_SHAPES)
def test_gpu_gluon_backward_matches_triton_bitwise(b, h, lq, lk, d, causal, dtype, monkeypatch, poison):
    """The Gluon backward computes the Triton kernels' numbers element for element (the same int8 blocks, exact
    int32 products, fp32 sums in the same order), so O, dQ, dK, dV are equal bit for bit, in q's dtype; outputs
    start as NaN (poison), so an element the Gluon kernels leave unwritten fails."""
    q, k, v, do = _inputs(b, h, lq, lk, d, dtype, "cuda", k_offset=1.0, seed=lq + lk + d)
    gluon, triton_path = _gluon_and_triton(monkeypatch, q, k, v, do, causal)
    _assert_equal(gluon, triton_path, (q, q, k, v))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_gluon_backward_nan_matches_triton(causal, monkeypatch, poison):
    """A NaN in one element of q (head 1, query 250): both backwards put NaN in the same places (its Q block's S
    rows, and what they reach) and agree bit for bit everywhere else; head 0 stays finite."""
    q, k, v, do = _inputs(1, 2, 300, 300, 128, torch.bfloat16, "cuda", k_offset=1.0, seed=5)
    q[0, 1, 250, 5] = float("nan")
    gluon, triton_path = _gluon_and_triton(monkeypatch, q, k, v, do, causal)
    for name, g, t in zip(("o", "dq", "dk", "dv"), gluon, triton_path):
        assert torch.isnan(t[0, 1]).any() and torch.isfinite(t[0, 0]).all(), name
        torch.testing.assert_close(g, t, rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_gluon_backward_matches_triton_at_8192(causal, monkeypatch, poison):
    """At a training-sized length, many query and key tiles per program (and the causal loops' long and short
    programs): still bit for bit."""
    q, k, v, do = _inputs(1, 4, 8192, 8192, 128, torch.bfloat16, "cuda", k_offset=1.0, seed=7)
    gluon, triton_path = _gluon_and_triton(monkeypatch, q, k, v, do, causal)
    _assert_equal(gluon, triton_path, (q, q, k, v))


@pytest.mark.gpu
def test_gpu_gluon_kernels_launch(monkeypatch):
    """The GPU runs the Gluon kernels (_sagebwd_dkdv, _sagebwd_dq) and not the Triton gradient kernels for a default
    sagebwd_attention backward, and the reverse with ATTNQAT_GLUON=0 (the profiler's kernel names)."""
    from torch.profiler import ProfilerActivity, profile

    ok, why = hopper_gluon.available()
    if not ok:
        pytest.skip(why)
    for name in PINS:
        monkeypatch.delenv(name, raising=False)
    q, k, v, do = _inputs(1, 2, 300, 333, 128, torch.bfloat16, "cuda", k_offset=1.0)

    def kernels():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _run_kernel(q, k, v, do, causal=True)
            torch.cuda.synchronize()
        names = " ".join(e.key for e in prof.key_averages())
        return {kernel: kernel in names for kernel in ("_sagebwd_dkdv", "_sagebwd_dq", "_attn_bwd_dkdv",
                                                        "_attn_bwd_dq", "_attn_bwd_preprocess")}

    monkeypatch.setenv(hopper_gluon.GLUON_ENV, "1")
    assert kernels() == {"_sagebwd_dkdv": True, "_sagebwd_dq": True, "_attn_bwd_dkdv": False, "_attn_bwd_dq": False,
                         "_attn_bwd_preprocess": True}
    monkeypatch.setenv(hopper_gluon.GLUON_ENV, "0")
    assert kernels() == {"_sagebwd_dkdv": False, "_sagebwd_dq": False, "_attn_bwd_dkdv": True, "_attn_bwd_dq": True,
                         "_attn_bwd_preprocess": True}
