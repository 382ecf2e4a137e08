"""SageBwd's int8 forward and backward in Gluon for sm_90 (attnqat/kernels/hopper_sagebwd.py): its forward, dK/dV and
dQ kernels compile for sm_90a on any machine whose Triton has Gluon's Hopper API, with int8 wgmma (the A operands
psi(P~), P^T, dS^T, dS from registers) and a bf16 one for dP only; sagebwd.gluon_forward and gluon_backward decide
when sagebwd_forward and sagebwd_backward run them; on an H100/H200 they give the Triton kernels' O, LSE, dQ, dK, dV
bit for bit (ATTNQAT_GLUON=0 runs those), ragged, causal, Lq != Lk, NaN included."""
import re
import warnings

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
    record(f"{head_dim},fwd", hopper_sagebwd.compile_forward(head_dim, causal))
for name, compiled in hopper_sagebwd.compile_backward(128, True, torch.float16).items():
    record(f"128,{name},fp16", compiled)
record("128,fwd,fp16", hopper_sagebwd.compile_forward(128, True, torch.float16))
print(json.dumps(out))
"""

WGMMA = r"wgmma\.mma_async\.sync\.aligned\."
ACC = r" \{[^}]*\}, "  # the accumulator's registers
SMEM_A = r"%rd\d+, %rd\d+"  # A and B from shared memory (64-bit descriptors)
REG_A = r"\{%r\d+,%r\d+,%r\d+,%r\d+\}, %rd\d+"  # A from four registers (16 int8 a thread), B from shared memory
SCORES = WGMMA + r"m64n64k32\.s32\.s8\.s8" + ACC + SMEM_A + r", [^;]*;"  # S or S^T: int8, both from shared memory


def _count(pattern, ptx):
    return len(re.findall(pattern, ptx))


def _int8_register_a(n, ptx):
    """int8 wgmma instructions of N = n with the A operand from registers."""
    return _count(WGMMA + rf"m64n{n}k32\.s32\.s8\.s8" + ACC + REG_A + r", [^;]*;", ptx)


@pytest.fixture(scope="module")
def compiled():
    """The three kernels compiled for sm_90a at head_dim 64 (non-causal) and 128 (causal), and at 128 causal for fp16:
    PTX, shared memory, ptxas's resource usage, SASS counts. A compile only, outside the interpreter, in a
    subprocess, once for the module's tests."""
    if hopper_gluon._MISSING:
        pytest.skip(f"cannot compile the Gluon sm_90 SageBwd kernels here: {hopper_gluon._MISSING}")
    return compiled_outside_interpreter(COMPILE, timeout=300)


def test_kernels_compile_for_sm90a(compiled):
    """The three kernels are Hopper kernels: sm_90a, 4-d TMA loads completing on mbarriers, a one-warp load partition
    at 24 registers and consumer warpgroups at 240 (setmaxnreg), within H100's shared memory; the only shared-memory
    stores and loads are warp_specialize's own few (psi(P~), P^T, dS^T, dS reach wgmma from registers, the forward's
    S and P~ change layout in registers, and O, LSE, dQ, dK, dV go out by global stores from the accumulators). No
    local memory. Stack: ptxas spills a few of the dK/dV kernel's registers at head_dim 128 (Triton 3.9: 64 bytes
    causal, 176 not; 3.6: 296 and 272), none at 64 nor in dQ; the forward's at most 32 (3.9: 24 bytes at 128
    non-causal, which this module does not compile, none here; 3.6: none)."""
    assert set(compiled) == {"64,fwd", "64,dkdv", "64,dq", "128,fwd", "128,dkdv", "128,dq", "128,fwd,fp16",
                             "128,dkdv,fp16", "128,dq,fp16"}
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
        stores, loads = (5, 34) if "dkdv" in key else (3, 2)  # the forward and dQ: warp_specialize's only
        assert ptx.count("st.shared") <= stores and ptx.count("ld.shared") <= loads, key
        match = re.fullmatch(r"REG:\d+ STACK:(\d+) SHARED:\d+ LOCAL:0", kernel["usage"])
        assert match, (key, kernel["usage"])
        stack = int(match[1])
        if key.startswith("128,dkdv"):
            assert stack <= 320, (key, kernel["usage"])
        elif "fwd" in key:
            assert stack <= 32, (key, kernel["usage"])
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
    scores = _count(SCORES, ptx)
    dp = _count(WGMMA + r"m64n64k16\.f32\.bf16\.bf16" + ACC + SMEM_A + r", [^;]*, 0, 0;", ptx)
    grads = _int8_register_a(grad_n(head_dim), ptx)
    assert (scores, dp, grads) == (2 * head_dim // 32, 2 * head_dim // 16, 2 * grad_instructions)
    assert ptx.count("wgmma.mma_async") == scores + dp + grads
    assert kernel["hgmma"] == dp and kernel["igmma"] == scores + grads
    assert kernel["full_waits"] == 2 * full_waits
    tiles = 2 if name == "dkdv" else 1
    assert ptx.count("cvt.rzi.s16.f32") == 2 * tiles * 32 and "copysign.f32" in ptx
    assert "cvt.rmi" not in ptx
    assert "max.NaN.f32" in ptx


@pytest.mark.parametrize("head_dim", [64, 128])
def test_forward_runs_int8_wgmma_with_a_register_operand(compiled, head_dim):
    """The forward, per consumer warpgroup (two of them), as its loop is written: tile 0's S = psi(Q) psi(K)^T is
    issued before the loop and every later tile's inside it, beside the previous tile's P V; the last tile's P V
    follows the loop. So the PTX holds two S sites and two P V sites a consumer, however many tiles run:

    S as int8 wgmma with both operands in shared memory (N = 64 keys, K = head_dim in steps of 32: head_dim / 32
    instructions a site); P V = psi(P~) psi(V) as int8 wgmma with psi(P~) from registers and psi(V)^T's tile from
    shared memory (N = head_dim, K = 64 keys: 2 instructions a site). No bf16 wgmma: the forward has no 16-bit
    product. Waits a consumer: one full wait for tile 0's S, then in the loop a wait that leaves one group in flight
    (S_j done, P_{j-1} V_{j-1} running through tile j's softmax) and a full one for that product, and a full one for
    the last product: 3 full and 1 partial, and the SASS holds the same full waits (ptxas serialised none) and as
    many IGMMA instructions, no HGMMA.

    psi(P~) = the truncating cast of 127 e + 0.5 (e >= 0, so it rounds half up as the Triton kernel's floor of
    127 e + 0.5): one cvt.rzi per element of each softmax site (32 a thread of a 64 x 64 tile), and no floor (cvt.rmi)
    nor copysign (the backward's rounding of signed values)."""
    kernel = compiled[f"{head_dim},fwd"]
    ptx = kernel["ptx"]
    scores = _count(SCORES, ptx)
    pv = _int8_register_a(head_dim, ptx)
    assert (scores, pv) == (2 * 2 * head_dim // 32, 2 * 2 * 2)
    assert ptx.count("wgmma.mma_async") == scores + pv
    assert kernel["hgmma"] == 0 and kernel["igmma"] == scores + pv
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx)
    assert sorted(waits) == ["0"] * 2 * 3 + ["1"] * 2
    assert kernel["full_waits"] == 2 * 3
    assert ptx.count("cvt.rzi.s16.f32") == 2 * 2 * 32
    assert "cvt.rmi" not in ptx and "copysign" not in ptx


def test_fp16_kernels_change_only_their_16_bit_parts(compiled):
    """With fp16 dO and V the backward's dP wgmma is an f16 one, and with an fp16 O the forward converts O to f16
    (two values an instruction: 64 x 128 / 128 threads / 2 a consumer) where it converted to bf16; nothing else
    changes: the int8 products and the SASS counts are the bf16 kernels'."""
    for name in ("fwd", "dkdv", "dq"):
        bf16, fp16 = compiled[f"128,{name}"], compiled[f"128,{name},fp16"]
        dp = 0 if name == "fwd" else 2 * 128 // 16
        assert _count(WGMMA + r"m64n64k16\.f32\.f16\.f16" + ACC + SMEM_A, fp16["ptx"]) == dp
        assert "bf16.bf16" not in fp16["ptx"]
        if name == "fwd":
            assert fp16["ptx"].count("cvt.rn.f16x2.f32") == bf16["ptx"].count("cvt.rn.bf16x2.f32") == 2 * 32
            assert "bf16" not in fp16["ptx"]
        int8 = re.compile(WGMMA + r"m64n\d+k32\.s32\.s8\.s8")
        assert int8.findall(fp16["ptx"]) == int8.findall(bf16["ptx"])
        for count in ("hgmma", "igmma", "full_waits"):
            assert fp16[count] == bf16[count], (name, count)


# --- When sagebwd_forward and sagebwd_backward run them: sagebwd.gluon_forward, gluon_backward ---------------------

PINS = ("ATTNQAT_SAGEBWD_FWD_CONFIG", "ATTNQAT_SAGEBWD_DKDV_CONFIG", "ATTNQAT_SAGEBWD_DQ_CONFIG")
PINNED = dict(zip(PINS, ("64,64,4,2", "64,128,8,2", "128,64,8,2")))  # a launch config each
# Each decision: its function, its precision argument, the launch-config variables of the Triton kernels that the
# Gluon ones replace (pinning one asks for those), and the hopper_sagebwd launcher it chooses
DECISIONS = {"forward": (S.gluon_forward, "pv", PINS[:1], "sagebwd_forward_sm90"),
             "backward": (S.gluon_backward, "bwd", PINS[1:], "sagebwd_dkdv_dq")}


@pytest.fixture
def runnable(monkeypatch):
    """A machine where the Gluon kernels can run (hopper_gluon.available says so), without any of the environment
    variables that choose the Triton kernels."""
    monkeypatch.setattr(hopper_gluon, "available", lambda device=None: (True, "Gluon sm_90 forward available"))
    for name in (hopper_gluon.GLUON_ENV, *PINS):
        monkeypatch.delenv(name, raising=False)
    return torch.device("cuda")


def _decide(what, device, **change):
    """gluon_forward's or gluon_backward's answer for the SPEC's int8 case at head_dim 128 (K-major copies, no
    smooth_q), with ``change`` made to it."""
    decide, precision, *_ = DECISIONS[what]
    return decide(device, **{"head_dim": 128, precision: "int8", "km": True, "smooth_q": False, **change})


@pytest.mark.parametrize("what", DECISIONS)
def test_gluon_covers_the_int8_pass_only(runnable, what):
    """Where Gluon runs, the SPEC's int8 forward (pv) or backward (bwd) on K-major copies without Q-smoothing at
    head_dim 64 and 128 takes the Gluon kernels; any other precision, row-major copies, smooth_q, or another head_dim
    the Triton ones, with a reason that names what the Gluon kernels cover."""
    precision = DECISIONS[what][1]
    covers = f"the Gluon {what} covers {precision}='int8' with K-major copies, no smooth_q, head_dim 64 or 128"
    assert _decide(what, runnable) == (True, "Gluon sm_90 forward available")
    assert _decide(what, runnable, head_dim=64)[0]
    for change in ({precision: "fp8"}, {precision: "bf16"}, {"km": False}, {"smooth_q": True}, {"head_dim": 96},
                   {"head_dim": 32}):
        assert _decide(what, runnable, **change) == (False, covers), change


@pytest.mark.parametrize("what", DECISIONS)
def test_gluon_env_chooses_the_triton_kernels(runnable, monkeypatch, what):
    """ATTNQAT_GLUON=0, or a pinned launch config of the Triton kernels that the Gluon ones replace (the forward's
    for gluon_forward, dK/dV's or dQ's for gluon_backward), turns them off and says so; the other pass's pinned
    configs do not (they choose that pass's kernels only), nor does ATTNQAT_GLUON=1."""
    own = DECISIONS[what][2]
    monkeypatch.setenv(hopper_gluon.GLUON_ENV, "1")
    assert _decide(what, runnable)[0]
    monkeypatch.setenv(hopper_gluon.GLUON_ENV, "0")
    assert _decide(what, runnable) == (False, "ATTNQAT_GLUON=0")
    monkeypatch.delenv(hopper_gluon.GLUON_ENV)
    for name in PINS:
        if name not in own:
            monkeypatch.setenv(name, PINNED[name])
    assert _decide(what, runnable)[0]
    for name in own:
        monkeypatch.setenv(name, PINNED[name])
        assert _decide(what, runnable) == (False, f"{name} pin the Triton kernels' launch config")
        monkeypatch.delenv(name)
    if what == "backward":
        for name in own:
            monkeypatch.setenv(name, PINNED[name])
        assert _decide(what, runnable) == (
            False, "ATTNQAT_SAGEBWD_DKDV_CONFIG and ATTNQAT_SAGEBWD_DQ_CONFIG pin the Triton kernels' launch config")


@pytest.mark.parametrize("what", DECISIONS)
def test_gluon_off_where_gluon_cannot_run(monkeypatch, what):
    """On a CPU tensor (here: the interpreter, or a CPU device beside a GPU) the answer is hopper_gluon.available's
    no, with its reason."""
    for name in (hopper_gluon.GLUON_ENV, *PINS):
        monkeypatch.delenv(name, raising=False)
    cpu = torch.device("cpu")
    ok, why = _decide(what, cpu)
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


def _forward(q, k, v, causal):
    """O and the LSE of an inference forward (the sagebwd_fwd op, as sagebwd_attention calls it without grad)."""
    return S.sagebwd_fwd(q, k, v, q.shape[-1] ** -0.5, causal, True, False, "int8", "int8", False, S.kmajor())[:2]


def test_forward_hands_its_operands_to_the_gluon_kernel(runnable, monkeypatch, poison):
    """Where gluon_forward says yes, sagebwd_forward calls hopper_sagebwd.sagebwd_forward_sm90 once per call, with
    what its docstring asks for (the pre-pass's codes: psi(Q), psi(K_s) row-major, psi(V) K-major in a kmajor_empty
    view, whose rows start 16 bytes apart as TMA needs; the block scales of 128 query and 64 key rows; contiguous O
    and an fp32 LSE per query), returns what it wrote, and never launches the Triton forward: for inference
    (sagebwd_attention without grad, and the sagebwd_fwd op, whose LSE is the kernel's), and for training, whose
    backward (the Triton kernels here) then runs on that O and LSE. Run in the interpreter with the Gluon launch
    replaced by a recorder (the kernel needs an H100); Lk = 150 pads the K-major rows to 160."""
    b, h, lq, lk, d = 1, 2, 80, 150, 64
    q, k, v, do = _inputs(b, h, lq, lk, d, torch.bfloat16, "cpu", k_offset=1.0)
    monkeypatch.delenv("ATTNQAT_SAGEBWD_KMAJOR", raising=False)
    monkeypatch.setattr(S, "gluon_backward", lambda *args: (False, "the Triton backward: this test is the forward's"))
    monkeypatch.setattr(S, "_attn_fwd", _NotLaunched("_attn_fwd"))
    kmean = k.mean(dim=2, dtype=torch.float32)  # smooth_k, the default
    codes = [S.quantize_int8_rows(x, block, mean) for x, block, mean in
             ((q, SAGEBWD_Q_BLOCK, None), (k, SAGEBWD_K_BLOCK, kmean), (v, SAGEBWD_K_BLOCK, None))]
    calls = []

    def record(q8, k8, vt, sq, sk, sv, o, lse, *, sm_scale, causal, q_block, k_block):
        calls.append(dict(sm_scale=sm_scale, causal=causal, q_block=q_block, k_block=k_block))
        for x8, sx, n, (x8_ref, _, sx_ref) in zip((q8, k8, vt.transpose(-1, -2)), (sq, sk, sv), (lq, lk, lk), codes):
            assert x8.dtype == torch.int8 and x8.shape == (b, h, n, d) and torch.equal(x8, x8_ref)
            assert sx.dtype == torch.float32 and torch.equal(sx, sx_ref)
        assert q8.is_contiguous() and k8.is_contiguous()
        assert vt.stride(-1) == 1 and vt.stride(-2) == 160  # a kmajor_empty view: rows of 150 codes, 160 apart
        nq, nk = -(-lq // SAGEBWD_Q_BLOCK), -(-lk // SAGEBWD_K_BLOCK)
        assert sq.shape == (b, h, nq) and sk.shape == sv.shape == (b, h, nk)
        assert o.shape == q.shape and o.is_contiguous()
        assert o.dtype == (torch.float32 if S.interpreting() else q.dtype)  # fp32 in the interpreter, as Triton's
        assert lse.shape == (b, h, lq) and lse.dtype == torch.float32 and lse.is_contiguous()
        o.fill_(0.25)
        lse.fill_(-1.5)

    monkeypatch.setattr(hopper_sagebwd, "sagebwd_forward_sm90", record)
    expected = dict(sm_scale=d ** -0.5, causal=True, q_block=SAGEBWD_Q_BLOCK, k_block=SAGEBWD_K_BLOCK)
    with torch.no_grad():
        o = S.sagebwd_attention(q, k, v, causal=True)
    assert calls == [expected] and o.dtype == q.dtype and (o == 0.25).all()
    o, lse = _forward(q, k, v, causal=True)
    assert calls == [expected] * 2 and (o == 0.25).all() and (lse == -1.5).all()
    o, dq, dk, dv = _run_kernel(q, k, v, do, causal=True)
    assert calls == [expected] * 3 and (o == 0.25).all()
    for g, x in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == x.shape and torch.isfinite(g).all()


@pytest.mark.parametrize("cap,warns", [((9, 0), True), ((8, 0), False)])
def test_an_sm90_gpu_without_gluon_warns(cap, warns, monkeypatch):
    """Where an sm_90 GPU cannot run the Gluon kernels (Triton < 3.6), SageBwd's forward and backward run the Triton
    ones and a warning names why (hopper_gluon.available_or_warn, as for the FP4 modes); elsewhere the Triton path is
    simply the path."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(hopper_gluon, "available", lambda device=None: (False, "Triton 3.5.1 lacks Gluon's Hopper API"))
    for name in (hopper_gluon.GLUON_ENV, *PINS):
        monkeypatch.delenv(name, raising=False)
    for decide in (S.gluon_forward, S.gluon_backward):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert decide(torch.device("cuda"), 128, "int8", True, False) == (
                False, "Triton 3.5.1 lacks Gluon's Hopper API")
        assert len(seen) == warns
        assert all("Triton 3.5.1 lacks" in str(w.message) and "sagebwd" in str(w.message) for w in seen)


# --- On an H100/H200: the Triton kernels' outputs, bit for bit -----------------------------------------------------


def _gluon_and_triton(monkeypatch, q, causal, run, what="backward"):
    """run() with the Gluon kernels of ``what`` (asserted chosen, and their launcher called once) and with the
    Triton ones (ATTNQAT_GLUON=0, which turns off both passes' Gluon kernels)."""
    ok, why = hopper_gluon.available()
    if not ok:
        pytest.skip(why)
    for name in (*PINS, "ATTNQAT_SAGEBWD_KMAJOR"):
        monkeypatch.delenv(name, raising=False)
    calls = []
    launcher = DECISIONS[what][3]
    real = getattr(hopper_sagebwd, launcher)
    monkeypatch.setattr(hopper_sagebwd, launcher, lambda *a, **kw: calls.append(kw["causal"]) or real(*a, **kw))
    monkeypatch.setenv(hopper_gluon.GLUON_ENV, "1")
    chosen = _decide(what, q.device, head_dim=q.shape[-1], km=S.kmajor())
    assert chosen == (True, "Gluon sm_90 forward available"), chosen  # else this compares Triton with Triton
    gluon = run()
    assert calls == [causal]
    monkeypatch.setenv(hopper_gluon.GLUON_ENV, "0")
    triton_path = run()
    assert calls == [causal]
    return gluon, triton_path


def _assert_equal(gluon, triton_path, like, names=("o", "dq", "dk", "dv")):
    for name, g, t, x in zip(names, gluon, triton_path, like, strict=True):
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
    gluon, triton_path = _gluon_and_triton(monkeypatch, q, causal, lambda: _run_kernel(q, k, v, do, causal=causal))
    _assert_equal(gluon, triton_path, (q, q, k, v))


@pytest.mark.gpu
@pytest.mark.parametrize("b,h,lq,lk,d,causal,dtype", GPU_SHAPES)
def test_gpu_gluon_forward_matches_triton_bitwise(b, h, lq, lk, d, causal, dtype, monkeypatch, poison):
    """The Gluon forward computes the Triton kernel's numbers element for element (the same int8 blocks, exact int32
    products, the same online softmax in the same order, psi(P~) rounded alike), so an inference forward's O (in q's
    dtype) and LSE (fp32) are equal bit for bit; they start as NaN (poison), so a row the Gluon kernel leaves
    unwritten fails."""
    q, k, v, _ = _inputs(b, h, lq, lk, d, dtype, "cuda", k_offset=1.0, seed=lq + lk + d)
    gluon, triton_path = _gluon_and_triton(monkeypatch, q, causal, lambda: _forward(q, k, v, causal), "forward")
    _assert_equal(gluon, triton_path, (q, torch.empty(q.shape[:-1], device="meta")), names=("o", "lse"))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_gluon_backward_nan_matches_triton(causal, monkeypatch, poison):
    """A NaN in one element of q (head 1, query 250): both backwards put NaN in the same places (its Q block's S
    rows, and what they reach) and agree bit for bit everywhere else; head 0 stays finite."""
    q, k, v, do = _inputs(1, 2, 300, 300, 128, torch.bfloat16, "cuda", k_offset=1.0, seed=5)
    q[0, 1, 250, 5] = float("nan")
    gluon, triton_path = _gluon_and_triton(monkeypatch, q, causal, lambda: _run_kernel(q, k, v, do, causal=causal))
    for name, g, t in zip(("o", "dq", "dk", "dv"), gluon, triton_path):
        assert torch.isnan(t[0, 1]).any() and torch.isfinite(t[0, 0]).all(), name
        torch.testing.assert_close(g, t, rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_gluon_backward_matches_triton_at_8192(causal, monkeypatch, poison):
    """At a training-sized length, many query and key tiles per program (and the causal loops' long and short
    programs): still bit for bit."""
    q, k, v, do = _inputs(1, 4, 8192, 8192, 128, torch.bfloat16, "cuda", k_offset=1.0, seed=7)
    gluon, triton_path = _gluon_and_triton(monkeypatch, q, causal, lambda: _run_kernel(q, k, v, do, causal=causal))
    _assert_equal(gluon, triton_path, (q, q, k, v))


@pytest.mark.gpu
def test_gpu_gluon_backward_takes_a_v_off_tma_alignment(monkeypatch, poison):
    """A contiguous V whose storage starts 2 bytes off a 16-byte boundary (a view one element into its buffer): TMA
    cannot read it in place, so the launcher copies it (hopper_gluon._tma_ready) and the gradients are the aligned
    V's, bit for bit."""
    q, k, v, do = _inputs(1, 2, 256, 256, 128, torch.bfloat16, "cuda", k_offset=1.0, seed=11)
    shifted = torch.empty(v.numel() + 1, dtype=v.dtype, device=v.device)[1:].view(v.shape)
    shifted.copy_(v)
    assert shifted.is_contiguous() and shifted.data_ptr() % 16 != 0

    def run(v):  # V as given (not cloned: a clone would be aligned), needing no gradient; dQ, dK read it through dP
        q_, k_ = (t.detach().clone().requires_grad_(True) for t in (q, k))
        o = S.sagebwd_attention(q_, k_, v)
        o.backward(do)
        return o.detach(), q_.grad, k_.grad

    aligned, _ = _gluon_and_triton(monkeypatch, q, False, lambda: run(v))
    off, _ = _gluon_and_triton(monkeypatch, q, False, lambda: run(shifted))
    _assert_equal(off, aligned, (q, q, k), names=("o", "dq", "dk"))


@pytest.mark.gpu
def test_gpu_gluon_kernels_launch(monkeypatch):
    """The GPU runs the Gluon kernels (_sagebwd_fwd, _sagebwd_dkdv, _sagebwd_dq) and not the Triton forward and
    gradient kernels for a default sagebwd_attention forward and backward, and the reverse with ATTNQAT_GLUON=0 (the
    profiler's kernel names); both run the Triton pre-passes (_attn_bwd_preprocess among them)."""
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
        return {kernel: kernel in names for kernel in ("_sagebwd_fwd", "_sagebwd_dkdv", "_sagebwd_dq", "_attn_fwd",
                                                        "_attn_bwd_dkdv", "_attn_bwd_dq", "_attn_bwd_preprocess")}

    gluon = {"_sagebwd_fwd": True, "_sagebwd_dkdv": True, "_sagebwd_dq": True, "_attn_fwd": False,
             "_attn_bwd_dkdv": False, "_attn_bwd_dq": False}
    monkeypatch.setenv(hopper_gluon.GLUON_ENV, "1")
    assert kernels() == {**gluon, "_attn_bwd_preprocess": True}
    monkeypatch.setenv(hopper_gluon.GLUON_ENV, "0")
    assert kernels() == {**{name: not ran for name, ran in gluon.items()}, "_attn_bwd_preprocess": True}
