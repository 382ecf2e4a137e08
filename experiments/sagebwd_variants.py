"""SageBwd speed variants on one GPU run: accuracy gate, then fwd and fwd+bwd beside cuDNN and flash SDPA.

    python experiments/sagebwd_variants.py               # ~5 minutes on an H100; writes $OUT/sagebwd_variants.json
    python experiments/sagebwd_variants.py --budget 120  # stop starting new work after 120 s
    python experiments/sagebwd_variants.py --combos int8/int8,fp8/fp8 --no-sweep

For every (pv, bwd) combination of ``sagebwd_attention`` (pv: forward P V; bwd: backward dV, dQ, dK; each
"int8", "fp8" or "bf16", see docs/sagebwd.md):
1. gradient cos-sims to exact fp32 attention at (1, 4, 4096, 128), non-causal, on Gaussian inputs and on
   Student-t(3) inputs with QK-RMSNorm (K offset +2 N(0, 1) per channel, as bench/sagebwd.py), checked
   against the SageBwd paper's dQ 0.966, dK 0.954, dV 0.999;
2. ``triton.testing.do_bench`` medians of the inference forward (no grad) and of forward + backward
   (``torch.autograd.grad``) at (1, 40, 32760, 128) bf16, beside cuDNN and flash SDPA
   (``torch.nn.attention.sdpa_kernel``) measured in the same run;
3. with budget left, a small launch-config sweep (env ATTNQAT_SAGEBWD_*_CONFIG) for the fastest variants,
   and the row-major 8-bit operand path (ATTNQAT_SAGEBWD_KMAJOR=0).

Every item runs in a worker subprocess that appends one JSON line per result; a variant that fails to
compile, runs out of resources or raises is reported and the next one runs; if the worker dies (a CUDA
fault poisons its context) the item it was running is reported as crashed and a fresh worker goes on.
Results: a table on stdout and ``$OUT/sagebwd_variants.json`` ($OUT defaults to ./bench_out).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAPER_COSINES = {"dq": 0.966, "dk": 0.954, "dv": 0.999}  # SageBwd paper, real activations (SPEC §4)
BIG = (1, 40, 32760, 128)  # Wan 2.1 14B self-attention at 480p
ACC = (1, 4, 4096, 128)
DISTS = ("gaussian", "student_t3_qknorm")
# The brief's six first (int8/int8 is SPEC §4), then the other three combinations.
COMBOS = ("int8/int8", "fp8/int8", "fp8/fp8", "bf16/bf16", "fp8/bf16", "int8/bf16", "int8/fp8", "bf16/int8",
          "bf16/fp8")
# Launch configs "BLOCK_M,BLOCK_N,WARPS,STAGES" tried for the fastest variants. Constraints (sagebwd.py):
# fwd BLOCK_N | 64 and | BLOCK_M; dK/dV BLOCK_M1 (first) | 128 and | BLOCK_N1; dQ BLOCK_N2 (second) | 64 and
# | BLOCK_M2; 8-bit MMAs reduce over >= 32. Defaults: fwd 128,64,8,3; dkdv 64,128,8,2; dq 128,64,8,2.
SWEEP = {
    "ATTNQAT_SAGEBWD_DKDV_CONFIG": ("32,128,4,3", "64,128,4,3", "64,64,4,3", "32,64,4,4"),
    "ATTNQAT_SAGEBWD_DQ_CONFIG": ("128,32,4,3", "128,64,4,3", "64,64,4,3", "64,32,4,4"),
    "ATTNQAT_SAGEBWD_FWD_CONFIG": ("128,64,4,3", "128,32,4,3", "64,64,4,3"),
}
DEVICE = "cuda"
COST_S = {"timing": 25.0, "accuracy": 8.0, "baseline": 12.0}  # rough seconds per item (compile included)


# ---------------------------------------------------------------------------------------------------
# Worker: runs items, one JSON line per result
# ---------------------------------------------------------------------------------------------------

_CACHE: dict = {}


def _big_inputs():
    import torch

    if "big" not in _CACHE:
        torch.manual_seed(0)
        q, k, v = (torch.randn(*BIG, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        _CACHE["big"] = (q, k, v, torch.randn_like(q))
    return _CACHE["big"]


def _acc_inputs(dist):
    """Inputs and exact fp32 outputs/gradients for one distribution (bench/sagebwd.py's recipe)."""
    from attnqat.kernels import reference as R
    from bench.sagebwd import accuracy_inputs

    if dist not in _CACHE:
        q, k, v, do = accuracy_inputs(dist, ACC, DEVICE)
        o = R.attention_fp32(q, k, v)
        _CACHE[dist] = ((q, k, v, do), (o, *R.attention_bwd_fp32(q, k, v, o, do)))
    return _CACHE[dist]


def _sdpa(backend_name):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend_name]

    def attn(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v)

    return attn


def _sagebwd(pv, bwd):
    from attnqat.kernels.sagebwd import sagebwd_attention

    return lambda q, k, v: sagebwd_attention(q, k, v, pv=pv, bwd=bwd)


def _time(attn, what):
    """Median ms of the inference forward (no grad) or of forward + backward (autograd.grad, no .grad
    accumulation) at BIG."""
    import torch
    import triton.testing

    q, k, v, do = _big_inputs()
    if what == "fwd":
        def fn():
            with torch.no_grad():
                attn(q, k, v)
        return triton.testing.do_bench(fn, warmup=100, rep=500, return_mode="median")

    def fn():
        torch.autograd.grad(attn(q, k, v), (q, k, v), do)
    return triton.testing.do_bench(fn, warmup=200, rep=2500, return_mode="median")


def _cos(a, b):
    import torch.nn.functional as F

    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def run_item(item: dict) -> dict:
    """One measurement. item: {kind: baseline|accuracy|timing, impl: cudnn|flash|"pv/bwd", env: {...}, ...}."""
    import torch

    kind, impl = item["kind"], item["impl"]
    out = dict(item)
    if kind == "baseline":
        attn = _sdpa(impl)
        out["fwd_ms"] = _time(attn, "fwd")
        out["fwdbwd_ms"] = _time(attn, "fwdbwd")
    elif kind == "accuracy":
        pv, bwd = impl.split("/")
        (q, k, v, do), exact = _acc_inputs(item["dist"])
        qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
        o = _sagebwd(pv, bwd)(qq, kk, vv)
        got = (o, *torch.autograd.grad(o, (qq, kk, vv), do))
        for name, x, e in zip(("o", "dq", "dk", "dv"), got, exact):
            if not torch.isfinite(x).all():
                raise FloatingPointError(f"{name} has non-finite entries")
            out[f"cos_{name}"] = _cos(x, e)
        out["meets_paper"] = all(out[f"cos_{n}"] >= f for n, f in PAPER_COSINES.items())
    elif kind == "timing":
        pv, bwd = impl.split("/")
        attn = _sagebwd(pv, bwd)
        if item.get("what", "both") in ("both", "fwd"):
            out["fwd_ms"] = _time(attn, "fwd")
        if item.get("what", "both") in ("both", "fwdbwd"):
            out["fwdbwd_ms"] = _time(attn, "fwdbwd")
    torch.cuda.synchronize()
    return out


def worker(items_path: str, results_path: str, deadline: float) -> None:
    import warnings

    import torch

    items = json.loads(pathlib.Path(items_path).read_text())
    with open(results_path, "a") as res:
        def emit(rec):
            res.write(json.dumps(rec) + "\n")
            res.flush()

        for item in items:
            if time.time() + COST_S[item["kind"]] > deadline:
                emit({**item, "status": "skipped (budget)"})
                continue
            emit({"started": item["id"]})
            saved = {k: os.environ.get(k) for k in item.get("env", {})}
            os.environ.update(item.get("env", {}))
            t0 = time.time()
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    rec = run_item(item)
                rec["status"] = "ok"
                rec["warnings"] = sorted({str(w.message)[:300] for w in caught})
            except Exception as e:  # noqa: BLE001 - a failing variant is reported, the next one runs
                rec = {**item, "status": "failed", "error": f"{type(e).__name__}: {str(e)[:1500]}"}
            finally:
                for key, val in saved.items():
                    if val is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = val
            rec["seconds"] = round(time.time() - t0, 1)
            emit(rec)
            print(_summary(rec), flush=True)
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------
# Orchestrator
# ---------------------------------------------------------------------------------------------------


def _summary(r: dict) -> str:
    head = f"[{r['kind']}] {r['impl']}" + (f" {r['dist']}" if "dist" in r else "") + \
        (f" {r['env']}" if r.get("env") else "")
    if r.get("status") != "ok":
        return f"{head}: {r.get('status')} {r.get('error', '')[:300]}"
    if r["kind"] == "accuracy":
        return head + ": " + " ".join(f"{n} {r['cos_' + n]:.5f}" for n in ("o", "dq", "dk", "dv")) + \
            ("" if r["meets_paper"] else "  BELOW THE PAPER")
    return head + ": " + " ".join(f"{w} {r[w]:.2f} ms" for w in ("fwd_ms", "fwdbwd_ms") if w in r)


def run_items(items: list[dict], deadline: float, log: list[dict]) -> list[dict]:
    """Run ``items`` in worker subprocesses (a fresh one after a crash); returns their result records."""
    done: dict = {}
    todo = list(items)
    while todo:
        with tempfile.TemporaryDirectory() as tmp:
            ip, rp = pathlib.Path(tmp, "items.json"), pathlib.Path(tmp, "results.jsonl")
            ip.write_text(json.dumps(todo))
            rp.touch()
            cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", str(ip), str(rp), str(deadline)]
            try:  # a hung item is killed: 2 minutes past the deadline at most
                proc = subprocess.run(cmd, cwd=ROOT, stdout=None, stderr=subprocess.PIPE, text=True,
                                      timeout=max(deadline - time.time(), 0) + 120)
            except subprocess.TimeoutExpired as e:
                err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
                proc = subprocess.CompletedProcess(cmd, -9, None, "timed out\n" + err)
            started = None
            for line in rp.read_text().splitlines():
                rec = json.loads(line)
                if "started" in rec:
                    started = rec["started"]
                else:
                    done[rec["id"]] = rec
                    started = None
        if proc.returncode != 0:
            tail = proc.stderr[-1500:]
            log.append({"worker_exit": proc.returncode, "stderr_tail": tail})
            print(f"worker exited {proc.returncode}; stderr tail:\n{tail}", flush=True)
            crashed = started
            if crashed is None:  # died outside an item (startup): give up on the rest
                for it in todo:
                    done.setdefault(it["id"], {**it, "status": "not run (worker died)", "error": tail})
                break
            it = next(i for i in todo if i["id"] == crashed)
            done[crashed] = {**it, "status": "crashed", "error": tail}
            print(_summary(done[crashed]), flush=True)
        todo = [i for i in todo if i["id"] not in done]
    return [done[i["id"]] for i in items if i["id"] in done]


def _phase1(combos):
    items = [{"kind": "baseline", "impl": b} for b in ("cudnn", "flash")]
    for c in combos:
        items += [{"kind": "accuracy", "impl": c, "dist": d} for d in DISTS]
        items.append({"kind": "timing", "impl": c})
    return items


def _phase2(rows, sweep: bool):
    """Row-major 8-bit operands for the SPEC default and the all-fp8 variant, then config sweeps for the
    fastest variant by fwd+bwd (backward kernels) and by fwd (forward kernel) that meet the paper."""
    items = [{"kind": "timing", "impl": c, "env": {"ATTNQAT_SAGEBWD_KMAJOR": "0"}} for c in ("int8/int8", "fp8/fp8")
             if any(r["impl"] == c and r["kind"] == "timing" and r["status"] == "ok" for r in rows)]
    if not sweep:
        return items
    ok_acc = {}
    for r in rows:
        if r["kind"] == "accuracy":
            ok_acc[r["impl"]] = ok_acc.get(r["impl"], True) and r.get("status") == "ok" and r["meets_paper"]
    timed = [r for r in rows if r["kind"] == "timing" and r["status"] == "ok" and not r.get("env")
             and ok_acc.get(r["impl"])]
    if not timed:
        return items
    best_fb = min(timed, key=lambda r: r["fwdbwd_ms"])["impl"]
    best_f = min(timed, key=lambda r: r["fwd_ms"])["impl"]
    for env in ("ATTNQAT_SAGEBWD_DKDV_CONFIG", "ATTNQAT_SAGEBWD_DQ_CONFIG"):
        items += [{"kind": "timing", "impl": best_fb, "what": "fwdbwd", "env": {env: c}} for c in SWEEP[env]]
    items += [{"kind": "timing", "impl": best_f, "what": "fwd", "env": {"ATTNQAT_SAGEBWD_FWD_CONFIG": c}}
              for c in SWEEP["ATTNQAT_SAGEBWD_FWD_CONFIG"]]
    return items


def _with_ratios(rows):
    base = {r["impl"]: r for r in rows if r["kind"] == "baseline" and r["status"] == "ok"}
    for r in rows:
        if r["kind"] in ("timing", "baseline") and r["status"] == "ok":
            for b in ("cudnn", "flash"):
                for w in ("fwd_ms", "fwdbwd_ms"):
                    if w in r and b in base:
                        r[f"{w[:-3]}_vs_{b}"] = r[w] / base[b][w]
    return rows


def table(rows) -> str:
    acc = {}
    for r in rows:
        if r["kind"] == "accuracy":
            acc.setdefault(r["impl"], {})[r["dist"]] = r
    lines = [f"shape {BIG} bf16 non-causal; cos-sims at {ACC} vs exact fp32 (paper: dQ 0.966, dK 0.954, dV 0.999)",
             "| impl (pv/bwd) | env | fwd ms | fwd+bwd ms | fwd/cuDNN | fwd+bwd/cuDNN | fwd+bwd/flash | "
             "cos gaussian dQ/dK/dV | cos t3-qknorm dQ/dK/dV | status |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda r, k, fmt: (fmt % r[k]) if k in r else "-"  # noqa: E731
    for r in rows:
        if r["kind"] == "accuracy":
            continue
        cosines = []
        for d in DISTS:
            a = acc.get(r["impl"], {}).get(d)
            cosines.append("-" if not a or a.get("status") != "ok" else
                           "/".join(f"{a['cos_' + n]:.4f}" for n in ("dq", "dk", "dv")) +
                           ("" if a["meets_paper"] else " (below)"))
        env = ",".join(f"{k.replace('ATTNQAT_SAGEBWD_', '')}={v}" for k, v in r.get("env", {}).items())
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')[:80]}"
        lines.append(f"| {r['impl']} | {env} | {f(r, 'fwd_ms', '%.2f')} | {f(r, 'fwdbwd_ms', '%.2f')} | "
                     f"{f(r, 'fwd_vs_cudnn', '%.2fx')} | {f(r, 'fwdbwd_vs_cudnn', '%.2fx')} | "
                     f"{f(r, 'fwdbwd_vs_flash', '%.2fx')} | {cosines[0]} | {cosines[1]} | "
                     f"{status.replace('|', '/')} |")
    for r in rows:
        if r["kind"] == "accuracy" and r.get("status") != "ok":
            lines.append(f"accuracy {r['impl']} {r['dist']}: {r['status']} {r.get('error', '')[:200]}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=285.0, help="seconds after which no new item starts")
    ap.add_argument("--combos", default=",".join(COMBOS), help="pv/bwd pairs, comma-separated")
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-config sweep")
    ap.add_argument("--worker", nargs=3, metavar=("ITEMS", "RESULTS", "DEADLINE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker[0], args.worker[1], float(args.worker[2]))

    import torch

    from attnqat.outputs import write_file_atomically
    from bench._report import environment

    if not torch.cuda.is_available():
        raise SystemExit("experiments/sagebwd_variants.py needs a CUDA GPU")
    deadline = time.time() + args.budget
    out_dir = pathlib.Path(os.environ.get("OUT", ROOT / "bench_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / "sagebwd_variants.json"
    env = environment()
    print(env, flush=True)
    log: list[dict] = []
    items = _phase1(args.combos.split(","))
    for i, it in enumerate(items):
        it["id"] = i

    def save(rows, phase):  # under a temporary name, then renamed: a run cut off keeps the last whole file
        doc = {"env": env, "phase": phase, "shape": BIG, "accuracy_shape": ACC, "paper_cosines": PAPER_COSINES,
               "rows": _with_ratios(rows), "worker_log": log}
        write_file_atomically(out_file, lambda tmp: tmp.write_text(json.dumps(doc, indent=1)))

    rows = run_items(items, deadline, log)
    save(rows, "variants")
    more = _phase2(rows, sweep=not args.no_sweep)
    for i, it in enumerate(more):
        it["id"] = len(items) + i
    if more:
        rows += run_items(more, deadline, log)
    save(rows, "done")
    print(table(_with_ratios(rows)))
    print(f"wrote {out_file}")


if __name__ == "__main__":
    main()
