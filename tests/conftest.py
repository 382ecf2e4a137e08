import importlib.util
import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

# OpenMP threads that spin while they wait for each other (libgomp's default) make torch's CPU ops 10-30x slower
# whenever another process holds a core (a small shared CI machine, this suite's own subprocesses); waiting
# passively costs next to nothing when the cores are free. Read once, when torch loads OpenMP: set before the
# import, and inherited by every subprocess a test starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

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


SEED_ENV = "ATTNQAT_TEST_SEED"


def test_seed(nodeid: str) -> int:
    """The seed of the test ``nodeid`` (see :func:`seed`)."""
    chosen = os.environ.get(SEED_ENV, "")
    if chosen == "random":
        return int.from_bytes(os.urandom(4), "little")
    return int(chosen) if chosen else zlib.crc32(nodeid.encode())


test_seed.__test__ = False  # a helper, not a test


@pytest.fixture(autouse=True)
def seed(request):
    """Seeds torch's global RNG before every test, so unseeded ``torch.randn`` inputs are fresh per test and per
    parameter (the seed is a hash of the test's node id) yet the same on every run; a failing test's report
    names its seed. ATTNQAT_TEST_SEED=<n> runs every test with seed n (to replay one, or to sweep),
    ATTNQAT_TEST_SEED=random draws a new seed per test and run."""
    value = test_seed(request.node.nodeid)
    torch.manual_seed(value)
    request.node.attnqat_seed = value
    return value


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    value = getattr(item, "attnqat_seed", None)
    if report.failed and value is not None:
        report.sections.append(("random seed", f"torch.manual_seed({value}); replay: {SEED_ENV}={value} "
                                               f"python -m pytest '{item.nodeid}'"))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``): on a small
    shared CPU, OpenMP threads that wait for each other make many small tensor ops 10-100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (a process group's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_forked(worker, args: tuple, nprocs: int, what: str, timeout: float = 300.0) -> None:
    """``worker(rank, *args)`` on ``nprocs`` processes forked from this one, or the test fails after ``timeout``
    seconds naming ``what``. Forked, not spawned: a spawned process imports torch and diffusers again (about 7 s
    each on a small shared CPU); a forked one starts with them. A worker that uses torch ops sets
    ``torch.set_num_threads(1)`` first (the parent's OpenMP threads are not forked; :func:`as_torchrun_rank`
    does)."""
    import torch.multiprocessing as mp

    assert not torch.distributed.is_initialized()  # a child must not inherit a process group
    context = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="fork")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            pytest.fail(f"{what} did not finish in {timeout:.0f} s")


def _gloo_rank(rank: int, world: int, port: int, out_dir: str, body) -> None:
    import traceback

    as_torchrun_rank(rank, world, port)
    try:
        torch.distributed.init_process_group("gloo")  # accelerate's state takes it up where a body builds one
        result = {"ok": body(rank)}
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def gloo_ranks(body, out_dir, what: str, world: int = 2) -> list:
    """``body(rank)`` on ``world`` processes forked from this one (:func:`run_forked`), each made a torchrun rank of
    one gloo group (:func:`as_torchrun_rank`); the JSON-able results, rank 0 first. A rank's exception fails the
    test with its traceback."""
    run_forked(_gloo_rank, (world, free_port(), str(out_dir), body), world, what)
    results = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
    for r in results:
        assert "ok" in r, r.get("traceback", r)[-3000:]
    return [r["ok"] for r in results]


def forked_process(fn, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """``fn()`` in a process forked from this one, returned as ``subprocess.run(..., capture_output=True,
    text=True)`` returns a command: ``returncode`` is ``fn``'s int result (None: 0), a ``SystemExit``'s code, 1
    (with the traceback on stderr) for any other exception, -N for a signal N; ``stdout`` and ``stderr`` hold all
    the process wrote to file descriptors 1 and 2, to the streams pytest had put in their place, and through
    logging (set up as in a fresh interpreter, see _run_as_command). A separate process as a command is one (its
    own pid, locks, signals, limits and exit status) without a new interpreter's imports (torch and diffusers:
    about 7 s a start on a small shared CPU). One intra-op thread (a forked process that uses the parent's OpenMP
    threads hangs), so its float sums may differ from this process's in the last bits. Not for what a fresh
    interpreter reads once at its start (environment variables read at import, a missing package)."""
    return forked_processes(fn, timeout=timeout)[0]


def forked_processes(*fns, timeout: float = 300.0) -> list[subprocess.CompletedProcess]:
    """Each of ``fns`` as :func:`forked_process` runs it, all at once (the suite has two cores)."""
    procs = []
    try:
        procs.extend(ForkedProcess(fn) for fn in fns)
        return [p.wait(time.monotonic() + timeout) for p in procs]
    finally:
        for p in procs:
            p.close()


class ForkedProcess:
    """``fn()`` in a process forked from this one now, as :func:`forked_process` runs it; :meth:`wait` for its
    result, while this process does other work meanwhile (the suite has two cores). :meth:`close` kills it if it still
    runs."""

    def __init__(self, fn):
        import tempfile

        self.out, self.err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self.status = None
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            _run_as_command(fn, self.out, self.err)  # never returns

    def _poll(self) -> bool:
        if self.status is None and (done := os.waitpid(self.pid, os.WNOHANG))[0]:
            self.status = os.waitstatus_to_exitcode(done[1])
        return self.status is not None

    def wait(self, deadline: float) -> subprocess.CompletedProcess:
        """Its result as ``subprocess.run`` returns a command's, or (killed) the test fails at ``deadline``
        (``time.monotonic()``)."""
        while not self._poll():
            if time.monotonic() > deadline:
                self.close()
                pytest.fail("a forked process did not finish in time")
            time.sleep(0.02)
        self.out.seek(0)
        self.err.seek(0)
        return subprocess.CompletedProcess([f"<fork of {os.getpid()}>"], self.status,
                                           self.out.read().decode(errors="replace"),
                                           self.err.read().decode(errors="replace"))

    def close(self) -> None:
        import signal

        if not self._poll():
            os.kill(self.pid, signal.SIGKILL)
            self.status = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        self.out.close()
        self.err.close()


def _run_as_command(fn, out, err) -> None:
    """In a forked process: ``fn()`` with its output in the files ``out`` and ``err``, then ``os._exit`` with its
    status (never back in pytest)."""
    import io
    import logging
    import traceback

    code = 1
    try:
        for stream, file in ((sys.stdout, out), (sys.stderr, err)):
            try:
                fd = stream.fileno()
            except (AttributeError, ValueError, io.UnsupportedOperation):  # capsys's: in memory
                continue
            os.dup2(file.fileno(), fd)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        was = {id(x): "stdout" for x in (sys.stdout, sys.__stdout__)}
        was.update({id(x): "stderr" for x in (sys.stderr, sys.__stderr__)})
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        # logging as in a fresh interpreter: no pytest handler on the root logger (a record no handler takes goes
        # to stderr), and a handler made on a std stream (or an earlier test's capture, closed now) writes to the
        # new one; by assignment, as setStream would flush the closed one, and with its flush too where it was
        # bound to the old stream's (diffusers' and transformers' handlers)
        root = logging.getLogger()
        root.handlers = [h for h in root.handlers if not type(h).__module__.startswith("_pytest")]
        for logger in [root, *logging.Logger.manager.loggerDict.values()]:
            for handler in getattr(logger, "handlers", ()):
                stream = getattr(handler, "stream", None)
                if id(stream) in was or getattr(stream, "closed", False):
                    handler.stream = getattr(sys, was.get(id(stream), "stderr"))
                    if "flush" in vars(handler):
                        handler.flush = handler.stream.flush
        torch.set_num_threads(1)
        result = fn()
        code = 0 if result is None else result
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else print(e.code, file=sys.stderr) or 1
    except BaseException:  # noqa: BLE001 - as Python reports an uncaught exception
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def as_torchrun_rank(rank: int, world: int, port: int) -> None:
    """Make a forked process rank ``rank`` of ``world`` as torchrun starts them on one host (its variables, the
    rendezvous at 127.0.0.1:``port``), with one intra-op thread (the parent's OpenMP threads are not forked) and
    fresh accelerate singletons (the parent's hold an earlier test's 1-process state)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)


def load_script(path: Path, name: str):
    """Import a file that is not in a package (app.py, scripts/*.py) as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compiled_outside_interpreter(code: str, timeout: int) -> dict:
    """Run ``code`` (a script that compiles kernels for some GPU arch and prints one JSON line last) in a fresh
    Python without TRITON_INTERPRET, so Triton compiles instead of interpreting; its JSON, or the test fails
    with the script's stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (NaN if either holds NaN)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def check_dropin_against_reference(q, k, v, **options) -> None:
    """attn_qat_dropin under grad with the FP4 options ``options`` (q, k, v bf16, requiring grad; the interpreter):
    its forward is nvfp4's with the same options, bit for bit, and its gradients the reference's high-precision
    backward's, to 1e-2 (both bf16: the reference's rounding of its fp32 gradients)."""
    from attnqat.kernels import attention
    from attnqat.kernels import reference as R
    from attnqat.kernels.attn_qat import nvfp4_attention

    o = attention(q, k, v, "attn_qat_dropin", **options)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(R.attn_qat_dropin_attention_ref(qr, kr, vr, **options), (qr, kr, vr), do)
    with torch.no_grad():
        assert torch.equal(o, nvfp4_attention(q, k, v, **options))
    for got, w in zip(grads, want):
        assert rel_err(got, w.float()) < 1e-2


def cos_sim(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # midpoints of the e2m1 grid (SPEC §1's tie table)


def fp4_rounding_ties(q: torch.Tensor, k: torch.Tensor, *, causal: bool = False, sm_scale: float | None = None,
                      block_n: int = 64, backward: str | None = "final_max", tol: float = 3e-6,
                      q_smoothing: bool = False, four_over_six: bool = False) -> bool:
    """Whether FP4 attention over q, k rounds something in P within ``tol`` (relative) of a tie: a 16-key block's
    scale amax/6 near an e4m3 midpoint, or an element P~/s near an e2m1 one; P~ of each forward tile (running
    max, ``block_n`` keys) and of Attn-QAT's backward (``backward``: its p_bwd, or None for none), as the
    reference computes them. ``tol`` = 3e-6 is about 10x the largest gap seen between the two fp32 paths (5 ulps).

    There the kernels and the reference may round to neighbouring values, which SPEC §1 allows: they reach
    the same number by fp32 paths a few ulps apart (the kernel takes exp2(x - m + log2 2688) and multiplies
    by 1/6, the reference takes 2688 * exp2(x - m) and divides). One such block moved a row of O by up to 12%,
    7x the bf16-rounding bound of the kernel tests: in sweeps, 1 of 300 random draws of
    test_dropin_backward_is_high_precision_with_fp4_output and about 9 of 10,300 of
    test_forward_and_backward_match_reference[shape5] failed so, every time with a block scale 5 ulps from
    an e4m3 midpoint. Tests whose bound is output rounding therefore draw inputs without such ties.
    ``q_smoothing``, ``four_over_six``: the logits of those options (reference.fp4_logits_ref)."""
    from attnqat.kernels import reference as R
    from attnqat.kernels.formats import P_SCALE

    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    s = R.fp4_logits_ref(q, k, sm_scale=scale, causal=causal, q_smoothing=q_smoothing, four_over_six=four_over_six)[0]
    m = torch.full(s.shape[:-1], float("-inf"))
    tiles = []
    for j in range(0, s.shape[-1], block_n):
        m = torch.maximum(m, torch.ceil(s[..., j:j + block_n].amax(-1)))
        tiles.append(s[..., j:j + block_n] - m[..., None])
    if backward == "final_max":
        tiles.append(s - m[..., None])
    elif backward == "normalized":  # phi(P~ / l): log2 of P~ / l
        tiles.append(s - m[..., None] - torch.log2(torch.exp2(s - m[..., None]).sum(-1, keepdim=True) * P_SCALE))
    for x in tiles:
        p = torch.nan_to_num(P_SCALE * torch.exp2(x), 0.0)  # rows with no visible key yet: 0
        p = torch.nn.functional.pad(p, (0, (-p.shape[-1]) % 16))
        blocks = p.reshape(*p.shape[:-1], -1, 16)
        a6 = blocks.amax(-1) / 6
        step = 2.0 ** (torch.floor(torch.log2(a6.clamp_min(2.0 ** -6))) - 3)  # e4m3: 8 steps a binade, 2^-9 below
        frac = a6 / step - torch.floor(a6 / step)
        if (((frac - 0.5).abs() * step) < tol * a6).any():
            return True
        sc = R.e4m3_scale_ref(blocks.amax(-1))
        y = blocks / torch.where(sc > 0, sc, torch.ones_like(sc))[..., None]
        ties = torch.tensor(E2M1_TIES)
        if ((y[..., None] - ties).abs() < tol * ties).any():
            return True
    return False
