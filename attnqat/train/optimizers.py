"""The optimizer of a run, ``train.optimizer``: ``adamw`` (torch's AdamW) or ``adamw8bit`` (torchao's AdamW8bit).

    optimizer = build("adamw8bit", params, lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

AdamW keeps two fp32 moments a weight, m and v: 8 bytes, twice the fp32 master weight itself. AdamW8bit
(``torchao.optim.AdamW8bit``, Dettmers et al. 2021, arXiv:2110.02861) keeps each in 8 bits: one uint8 code a
value into a 256-entry dynamic map, and one fp32 scale (the block's largest magnitude) per block of values, so
about 2 bytes a weight. The update itself is AdamW's, computed in fp32 from the dequantized moments.

:class:`AdamW8bit` is torchao's with three changes, each for the checkpoints or the loop:

- **Which moments are 8-bit, and the blocks, follow the weight's rows.** torchao quantizes a moment when the
  process's own part of the weight has >= 4096 values and a multiple of 256, in blocks of 256 over that part;
  under FSDP that part is a shard, so the choice and the blocks would change with the process count (and could
  differ between processes, which a gather of the state cannot take). Here the choice is made on the whole
  weight: a matrix (2 or more dims) of >= 4096 values whose rows (the values past dim 0) split into blocks of
  ``gcd(row, 256)`` >= 64 values. FSDP shards whole rows of dim 0, so no block straddles two processes, and the
  codes and scales shard, gather and reshard as the weight does. Vectors (biases, norms) and small matrices keep
  fp32 moments, as in torchao's and bitsandbytes' rule for small tensors; in Wan 2.1 14B they are 0.03% of the
  weights.
- **Its state_dict holds plain tensors.** A quantized moment ``KEY`` is saved as ``KEY_codes`` (uint8, the
  weight's shape) and ``KEY_scales`` (fp32, one row of block scales per row of the weight), DTensors sharded as
  the weight is under FSDP2: what safetensors and torch.distributed.checkpoint store, and exactly what the
  optimizer held (the codes are not dequantized and quantized again, which is not exact: a block whose largest
  magnitude is negative has no code for -1 and gets another scale).
- **The learning rate stays a Python float** between steps (torchao makes it a tensor, so that its compiled
  step does not recompile when it changes): the LR scheduler, the log and optimizer.json read it as one. The
  step hands torchao a tensor of it, and on the CPU runs torchao's update eagerly: inductor compiles one C++
  kernel per weight shape, 88 s for the tiny model's 14 shapes on two cores against 0.2 s a step eagerly.

torchao runs on DTensors (FSDP2: ``fully_shard``), not on FSDP1's flat shards (1-D views, whose moments would all
stay fp32 here): :func:`check_sharding` refuses that pairing. A state saved by the other optimizer is refused on
load (CheckpointError), by either optimizer; a run resuming a checkpoint of the other ``train.optimizer`` is refused
before that, before a model is built, from the optimizer its optimizer.json records
(:func:`.checkpoint.check_optimizer`).
"""
from __future__ import annotations

import math
from itertools import chain

import torch

from .checkpoint import CheckpointError

OPTIMIZERS = ("adamw", "adamw8bit")
MIN_VALUES = 4096   # torchao's (and bitsandbytes') threshold: smaller tensors keep fp32 moments
MAX_BLOCK = 256     # torchao's block for AdamW8bit
MIN_BLOCK = 64      # a block's fp32 scale costs 4 / block bytes a value: at most 1/16 of the 8-bit code
MOMENTS = {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False}  # state key: signed code map


def require_torchao(what: str = "train.optimizer 'adamw8bit'") -> None:
    """ValueError in one line where torchao cannot be imported."""
    try:
        import torchao.optim  # noqa: F401
    except ImportError as e:
            raise ValueError(f"{what} needs torchao ({e}): pip install torchao") from None


def check_sharding(name: str, fsdp_version: int | None) -> None:
    """``name`` under this run's FSDP (None: none): adamw8bit needs FSDP2's DTensors (a one-line ValueError)."""
    if name == "adamw8bit" and fsdp_version == 1:
        raise ValueError("train.optimizer 'adamw8bit' needs FSDP2 (accelerate's fsdp_version: 2, "
                         "configs/fsdp2_wan14b.yaml): FSDP1 hands the optimizer flat 1-D shards of the weights, whose "
                         "moments would all stay fp32")


def build(name: str, params, *, lr: float, betas, eps: float, weight_decay: float,
          fused: bool | None = None) -> torch.optim.Optimizer:
    """The optimizer ``name`` (:data:`OPTIMIZERS`) over ``params``. ``fused``: torch AdamW's (adamw only; the
    graphed step uses it: one kernel launch per dtype, where the multi-tensor one kept mini's H200 idle 4-9 ms a
    step); adamw8bit has none, and its step runs outside the graphs as AdamW's does."""
    betas = tuple(float(b) for b in betas)
    if name == "adamw":
        optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused)
        optimizer.register_load_state_dict_pre_hook(_refuse_8bit_state)
        return optimizer
    if name == "adamw8bit":
        return adamw8bit_class()(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    raise ValueError(f"train.optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}")


def block_size(p: torch.Tensor) -> int | None:
    """The block of ``p``'s 8-bit moments (values per fp32 scale, within one row of dim 0), or None where they
    stay fp32. From the whole weight's shape (a DTensor's is), so every process and process count agrees."""
    if p.dim() < 2 or p.numel() < MIN_VALUES:
        return None
    block = math.gcd(p.numel() // p.shape[0], MAX_BLOCK)
    return block if block >= MIN_BLOCK else None


def _refuse_8bit_state(optimizer, state_dict: dict) -> None:
    """AdamW's load_state_dict pre-hook: a state saved by :class:`AdamW8bit` (moments as codes) is refused, not taken
    as AdamW's (torch would keep the codes as unknown entries and step on whatever moments it had)."""
    if any(k.endswith("_codes") for entries in state_dict.get("state", {}).values() for k in entries):
        raise CheckpointError("the saved optimizer state is train.optimizer 'adamw8bit''s (8-bit moments), this run's "
                              "is 'adamw': resume with the optimizer it was trained with")


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _like(p: torch.Tensor, local: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``local`` as this process's part of a tensor of ``shape`` sharded as the weight ``p`` is (dim 0 only), a
    DTensor where ``p`` is one; ``local`` itself otherwise."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(p, DTensor):
        return local
    if any(not (isinstance(x, Replicate) or (isinstance(x, Shard) and x.dim == 0)) for x in p.placements):
        raise ValueError(f"train.optimizer 'adamw8bit' takes weights sharded along dim 0 (FSDP2's default), got "
                         f"placements {p.placements}")
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=torch.Size(shape),
                              stride=stride)


_CLASS = None


def adamw8bit_class() -> type:
    """:class:`AdamW8bit`, built on first use: torchao is optional (``pip install torchao``)."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    require_torchao()
    from torchao.optim import AdamW8bit as TorchaoAdamW8bit
    from torchao.optim.adam import single_param_adam
    from torchao.optim.subclass_8bit import OptimState8bit

    class AdamW8bit(TorchaoAdamW8bit):
        """torchao's AdamW8bit with row-aligned blocks, a plain-tensor state_dict and a float lr (module docstring)."""

        def add_param_group(self, param_group: dict) -> None:
            torch.optim.Optimizer.add_param_group(self, param_group)  # torchao's makes lr a tensor here

        def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
            local, block = _local(p), block_size(p)
            if block is None or local.numel() == 0:  # fp32; or the empty shard of a process holding no row
                out = torch.zeros_like(local)
            else:
                out = OptimState8bit.zeros(local.shape, signed, block, local.device, dtype=local.dtype)
            return _like(p, out, tuple(p.shape)).to(p.device)

        @torch.no_grad()
        def step(self, closure=None):
            """torchao's step (its per-weight update, ``single_param_adam``), compiled as torchao compiles it, or
            on the CPU eagerly; lr handed over as a tensor."""
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            update = single_param_adam if self._on_cpu() else \
                torch.compile(single_param_adam, fullgraph=True, dynamic=False)
            with torch._dynamo.utils.disable_cache_limit():  # torchao's: one graph per weight shape, a fixed number
                for group in self.param_groups:
                    lr = torch.tensor(float(group["lr"]), dtype=torch.float32)  # a tensor: no recompile as it changes
                    for p in group["params"]:
                        if p.grad is None:
                            continue
                        state = self.state[p]
                        if not state:
                            state["step"] = torch.tensor(0.0)
                            state["exp_avg"] = self._new_buffer(p, True)
                            state["exp_avg_sq"] = self._new_buffer(p, False)
                            if group["amsgrad"]:
                                state["max_exp_avg_sq"] = self._new_buffer(p, False)
                        state["step"] += 1
                        update(p.detach(), p.grad, state["step"], state["exp_avg"], state["exp_avg_sq"],
                               state.get("max_exp_avg_sq"), lr, group["betas"][0], group["betas"][1],
                               group["weight_decay"], group["eps"], True,
                               self.bf16_stochastic_round and p.dtype is torch.bfloat16)
            return loss

        def _on_cpu(self) -> bool:
            return all(p.device.type == "cpu" for g in self.param_groups for p in g["params"])

        def _params(self) -> list[torch.Tensor]:
            return list(chain.from_iterable(g["params"] for g in self.param_groups))

        def state_dict(self) -> dict:
            sd = super().state_dict()  # {"state": {index: {key: tensor}}, "param_groups": [...]}, indices in order
            sd["state"] = {i: dict(entries) for i, entries in sd["state"].items()}  # torch's are the live dicts
            params = self._params()
            for index, entries in sd["state"].items():
                p, block = params[index], block_size(params[index])
                if block is None:
                    continue
                rows = p.shape[0]
                for key in [k for k in MOMENTS if k in entries]:
                    local = _local(entries.pop(key))
                    local_rows = _local(p).shape[0]
                    if isinstance(local, OptimState8bit):
                        codes, scales = local.codes, local.scale.view(local_rows, -1)
                    else:  # a process holding no row of p
                        codes = torch.zeros(local.shape, dtype=torch.uint8, device=local.device)
                        scales = torch.zeros(local_rows, p.numel() // rows // block, device=local.device)
                    entries[f"{key}_codes"] = _like(p, codes, tuple(p.shape))
                    entries[f"{key}_scales"] = _like(p, scales, (rows, p.numel() // rows // block))
            return sd

        def load_state_dict(self, state_dict: dict) -> None:
            saved = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
            params = dict(zip(saved, self._params()))
            state, pieces = {}, {}
            for i, entries in state_dict["state"].items():
                entries = dict(entries)
                eight_bit, coded = block_size(params[i]) is not None, [k for k in MOMENTS if f"{k}_codes" in entries]
                # (torch's full-state load merges the saved keys into this run's: both kinds may be there)
                if bool(coded) != eight_bit or (eight_bit and MOMENTS.keys() & entries.keys()):
                    raise CheckpointError(f"the saved optimizer state keeps {'fp32' if eight_bit else '8-bit'} moments "
                                          f"for a weight of shape {tuple(params[i].shape)} where train.optimizer "
                                          f"'adamw8bit' keeps {'8-bit' if eight_bit else 'fp32'} ones: another "
                                          f"optimizer's; resume with the optimizer it was trained with")
                for key in coded:
                    pieces[i, key] = entries.pop(f"{key}_codes"), entries.pop(f"{key}_scales")
                state[i] = entries
            # torch's: the param groups, the steps and the fp32 moments (cast to each weight's dtype and device)
            super().load_state_dict({**state_dict, "state": state})
            for (i, key), (codes, scales) in pieces.items():
                p = params[i]
                out = self._new_buffer(p, MOMENTS[key])
                local = _local(out)
                if isinstance(local, OptimState8bit):  # else the empty shard of a process holding no row
                    local.codes.copy_(_local(codes))
                    local.scale.copy_(_local(scales).reshape(-1))
                self.state[p][key] = out

    _CLASS = AdamW8bit
    return AdamW8bit
