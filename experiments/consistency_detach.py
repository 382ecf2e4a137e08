"""Should the attention-consistency term's exact output o_ref be detached? (attnqat/train/consistency.py,
docs/training.md, "The attention-consistency term")

    python experiments/consistency_detach.py [--seeds 5] [--steps 12] [--lr 3e-4]     # CPU, about a minute

On the tiny model (configs/tiny.yaml's feature distillation, attention weights trained, batch 4, the FP4 reference
path), the term c = mean over layers of ||o_fp4 - o_ref||^2 / ||o_ref||^2 two ways: as the package computes it,
gradients through both branches, and with o_ref detached (the exact attention run under no_grad). Prints

- the two gradients of c on one batch, over every weight and over the self-attention's q/k/v projections and Q/K
  norms: their norms and cosine;
- c on the held-out inputs after ``--steps`` steps with weight 1 each way, and with weight 0, per config seed; and
  at the end, on the same inputs, the student's own FP4 error at its output (nmse of its velocity with FP4
  attention against the same weights' with bf16 attention) and how far its bf16 function moved from the teacher's
  (nmse of those bf16 velocities): what a lower c bought at the output, and what it cost.

Why it can matter: Attn-QAT's backward is straight-through, the exact attention's Jacobian at the quantized
operands, so dc/dθ = 2 (o_fp4 - o_ref) (J_fp4 - J_ref) dθ / ||o_ref||^2 (with o_ref in the graph) is the gradient
of the layer's FP4 error as the straight-through model sees it; detached, the J_ref part is gone and the gradient
mostly moves o_fp4 and o_ref together, the error hardly at all.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from pathlib import Path

import torch

from attnqat.kernels import REFERENCE_MODE
from attnqat.pipelines.processor import AttnQATProcessor
from attnqat.train import Trainer, load_config
from attnqat.train.consistency import AttentionConsistency
from attnqat.train.objectives import nmse
from attnqat.train.student_teacher import AutocastAttnProcessor

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


@contextlib.contextmanager
def detached_reference():
    """The training processor with o_ref computed under no_grad (the alternative to the package's choice)."""
    ours = AutocastAttnProcessor._attend

    def attend(self, query, key, value, parallel_config):
        out = AttnQATProcessor._attend(self, query, key, value, parallel_config)
        if self.consistency is not None and torch.is_grad_enabled():
            with torch.no_grad():
                ref = self._attention(query, key, value, REFERENCE_MODE, {}, parallel_config)
            self.consistency.record(self.consistency_layer, out, ref.flatten(2, 3))
        return out
    AutocastAttnProcessor._attend = attend
    try:
        yield
    finally:
        AutocastAttnProcessor._attend = ours


def trainer(out: str, weight: float, seed: int, lr: float, *extra: str) -> Trainer:
    return Trainer(load_config(TINY, [f"output_dir={out}", "log.progress=false", "data.batch_size=4", "data.held_out=8",
                                      "train.gradient_checkpointing=false", f"objective.attention_consistency={weight}",
                                      f"seed={seed}", f"train.lr={lr}", *extra]))


def output_errors(t: Trainer) -> tuple[float, float]:
    """(the student's own FP4 error at the output, its bf16 function's distance to the teacher's), held out."""
    own, moved = [], []
    processors = [b.attn1.processor for b in t.student.blocks]
    with torch.no_grad():
        for batch in t.held_out():
            fp4 = t._forward(t.student, batch)
            for p in processors:
                p.mode = REFERENCE_MODE
            bf16 = t._forward(t.student, batch)
            for p in processors:
                p.mode = t.cfg.attention.mode
            own.append(nmse(fp4, bf16).item())
            moved.append(nmse(bf16, t._forward(t.teacher, batch)).item())
    return sum(own) / len(own), sum(moved) / len(moved)


def gradients(out: str) -> None:
    t = trainer(out, 1.0, 0, 1e-4, "train.trainable=all")
    named = [(n, p) for n, p in t.student.named_parameters() if p.requires_grad]
    batch = t.micro_batch(0, 0)
    grads = {}
    for way, ctx in (("through both", contextlib.nullcontext()), ("detached", detached_reference())):
        with ctx:
            g = torch.autograd.grad(t.losses(batch)["consistency"], [p for _, p in named], allow_unused=True)
        grads[way] = {n: (x if x is not None else torch.zeros_like(p)) for (n, p), x in zip(named, g)}
    for label, keep in (("every weight", lambda n: True),
                        ("attn1 to_q/to_k/to_v", lambda n: any(f"attn1.{x}." in n for x in ("to_q", "to_k", "to_v"))),
                        ("attn1 norm_q/norm_k", lambda n: "attn1.norm_q" in n or "attn1.norm_k" in n)):
        a, d = (torch.cat([v.flatten() for n, v in grads[w].items() if keep(n)]) for w in ("through both", "detached"))
        print(f"gradient of c, {label:20s}: |through both| {a.norm():.3e}  |detached| {d.norm():.3e}  "
              f"ratio {a.norm() / d.norm():.3f}  cosine {torch.nn.functional.cosine_similarity(a, d, dim=0):.3f}")


def steps(out: str, seeds: int, n: int, lr: float) -> None:
    for seed in range(seeds):
        ends = {}
        for weight, way in ((0.0, "-"), (1.0, "through both"), (1.0, "detached")):
            with detached_reference() if way == "detached" else contextlib.nullcontext():
                t = trainer(out, weight, seed, lr)
                probe = t.consistency or AttentionConsistency(t.student)
                start = probe.held_out_mean(t)
                for step in range(n):
                    t.losses(t.micro_batch(step, 0))["loss"].backward()
                    t.optimizer.step()
                    t.optimizer.zero_grad(set_to_none=True)
                ends[(weight, way)] = end = probe.held_out_mean(t)
                own, moved = output_errors(t)
                t.s_cap.remove()
                t.t_cap.remove()
            print(f"seed {seed}, weight {weight:g} ({way}): held-out c {start:.5f} -> {end:.5f} "
                  f"({end / start - 1:+.1%}); output: own FP4 error {own:.3e}, bf16 function moved {moved:.3e}")
        base = ends[(0.0, "-")]
        print(f"seed {seed}: against weight 0, through both {ends[(1.0, 'through both')] / base:.3f}, "
              f"detached {ends[(1.0, 'detached')] / base:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr", type=float, default=3e-4)
    args = parser.parse_args()
    os.environ["TRITON_INTERPRET"] = "0"  # the FP4 reference path (fp32); read per call
    torch.set_num_threads(1)  # tiny tensors: threads only wait for each other
    with tempfile.TemporaryDirectory() as out:
        gradients(out)
        steps(out, args.seeds, args.steps, args.lr)


if __name__ == "__main__":
    main()
