"""The numbers that define the formats (SPEC §1-4), in one module that imports nothing.

The kernels and the references both read them from here, so ``reference.py`` never has to import
the code it checks (``tests/test_structure.py`` holds that rule).
"""

# NVFP4 (SPEC §1): e2m1 values, one e4m3 scale per block of 16
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitudes by 3-bit code (sign is bit 3)
P_SCALE = E4M3_MAX * E2M1_MAX  # 2688: SageAttention3's two-level scale for P (SPEC §2)

LOG2E = 1.4426950408889634  # exponents are kept in log2 units: exp(x) = exp2(x * log2(e))

SAGE3_Q_BLOCK = 128  # SPEC §3: Q is smoothed per block of 128 query rows

SAGEBWD_Q_BLOCK = 128  # SPEC §4: psi(Q) and psi(dO) share one scale per 128 rows
SAGEBWD_K_BLOCK = 64   # SPEC §4: psi(K) and psi(V) share one scale per 64 rows
# SageBwd's pv (forward P V) and bwd (backward dV, dQ, dK) options; a kernel's PV / BWD constexpr is the index
SAGEBWD_PRECISIONS = ("int8", "fp8", "bf16")
