"""The student and the teacher: one Wan transformer patched for training, and its frozen copy.

The student runs a trainable attention mode (``attn_qat``) in the selected layers; the teacher, a copy of the
same initial weights, runs the reference mode (bf16, exact SDPA) in the same layers. Both use
:class:`AutocastAttnProcessor`, so under mixed precision their attention sees the same input dtype. With
``train.trainable: lora`` the student is the frozen transformer with a LoRA adapter, and the teacher is no copy:
:class:`AdapterOffTeacher` runs the same module with the adapter off and the reference attention.
:class:`FeatureCapture` records every block's output hidden states, for feature distillation and the
held-out gap. :func:`block_checkpoint` is the student's gradient checkpointing (``train.save_attention``, FSDP2's
input casts). The attention-consistency term's recorder is :mod:`.consistency`. Under FSDP,
:func:`shard_teacher` shards the teacher copy over the processes as the student is sharded (``train.shard_teacher``).
"""
from __future__ import annotations

import copy
import functools
from contextlib import contextmanager, nullcontext

import torch
from diffusers.models.transformers.transformer_wan import WanTransformerBlock
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from attnqat.kernels import REFERENCE_MODE, saved_tensors_recomputed
from attnqat.pipelines.lora import add_lora
from attnqat.pipelines.processor import AttnQATProcessor, patch_attention, processors_swapped


class AutocastAttnProcessor(AttnQATProcessor):
    """:class:`AttnQATProcessor` that casts fp32 Q/K/V to the autocast dtype when autocast is on.

    With fp32 master weights under bf16 autocast, Wan's RMSNorm on Q/K (fp32 weight) and RoPE hand the
    attention fp32 tensors. torch's SDPA is on autocast's low-precision list, so the bf16 mode would run
    in bf16 anyway; the FP4 Triton kernels take only bf16/fp16. Casting here gives both the same inputs.

    With ``objective.attention_consistency`` > 0 the student's self-attention processors also hold the run's
    :class:`~.consistency.AttentionConsistency`: with grad on, each also runs the reference mode on the same q, k,
    v and hands both outputs to it. Its own output is the same either way.
    """

    consistency = None  # an AttentionConsistency (consistency.py) with objective.attention_consistency > 0
    consistency_layer = 0  # this layer's key in it

    def _attention(self, query, key, value, *args, **kwargs):
        dev = query.device.type
        if query.dtype == torch.float32 and torch.is_autocast_enabled(dev):
            dt = torch.get_autocast_dtype(dev)
            query, key, value = query.to(dt), key.to(dt), value.to(dt)
        return super()._attention(query, key, value, *args, **kwargs)

    def _attend(self, query, key, value, parallel_config):
        out = super()._attend(query, key, value, parallel_config)
        # Only with grad: evaluation and inference (no_grad) never pay for it; checkpointing's recompute (grad on)
        # must run it again, since it has to save what the forward saved.
        if self.consistency is not None and torch.is_grad_enabled():
            # not detached: the term's gradient is that of the layer's FP4 error, through both branches (consistency.py)
            ref = self._attention(query, key, value, REFERENCE_MODE, {}, parallel_config)
            self.consistency.record(self.consistency_layer, out, ref.flatten(2, 3))
        return out


def patch_for_training(transformer: torch.nn.Module, mode: str, layers="self", **options) -> list[str]:
    """``patch_attention`` with :class:`AutocastAttnProcessor` processors; returns the patched modules' names."""
    return patch_attention(transformer, mode, layers, processor_class=AutocastAttnProcessor, **options)


def cast_all(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``module.to(dtype)`` in place, through torch's own ``Module.to``: the teacher is cast whole, the modules that
    diffusers' ``from_pretrained`` keeps in fp32 included, as it always has been (docs/training.md,
    ``train.teacher_dtype``), and diffusers' ``ModelMixin.to`` would warn at every run's start that they should stay
    fp32."""
    return torch.nn.Module.to(module, dtype)


def cast_copy(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``copy.deepcopy(module).to(dtype)`` without its full-precision intermediate: each floating-point
    parameter and buffer is cast as it is copied (through deepcopy's memo), so the peak is the original
    plus the copy in ``dtype`` (Wan 14B in fp32 with a bf16 teacher: 86 GB, not 114 GB, a process)."""
    memo: dict[int, object] = {}
    for t in [*module.parameters(), *module.buffers()]:
        if t.is_floating_point() and id(t) not in memo:
            c = t.detach().to(dtype, copy=True)
            memo[id(t)] = torch.nn.Parameter(c, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else c
    return cast_all(copy.deepcopy(module, memo), dtype)  # whatever else Module.to casts (complex buffers)


class AdapterOffTeacher:
    """The teacher of a LoRA run: the student's own transformer with its adapter off (diffusers'
    ``disable_adapters``) and the reference mode's attention in the student's patched layers, so that no second
    copy of the weights is held (Wan 14B's frozen weights are 28 GB in bf16).

    ``teacher(...)`` calls ``forward_module`` inside :meth:`active`: the transformer, or the module accelerate
    wrapped around it (the :class:`~.loop.Trainer` sets it after ``prepare``: FSDP gathers the weights in its
    wrapper's forward). Its blocks are the student's, so a :class:`FeatureCapture` on ``transformer`` records the
    teacher's features while it captures.
    """

    def __init__(self, transformer: torch.nn.Module, names: list[str]):
        self.transformer = transformer
        self.forward_module = transformer
        # built once: a compiled block meets the same processors every step (processors_swapped)
        self._swaps = [(transformer.get_submodule(n), AutocastAttnProcessor(REFERENCE_MODE)) for n in names]

    @contextmanager
    def active(self):
        """Inside the block the transformer is the teacher; after it, even when the block raises, the student
        again (its processors back, the adapter on and trainable)."""
        with processors_swapped(self._swaps):
            self.transformer.disable_adapters()
            try:
                yield self.transformer
            finally:
                self.transformer.enable_adapters()  # peft's: also makes the adapter's weights trainable again

    def __call__(self, *args, **kwargs):
        with self.active():
            return self.forward_module(*args, **kwargs)


def make_student_teacher(transformer: torch.nn.Module, mode: str, layers="self", options: dict | None = None,
                         teacher_dtype: torch.dtype = torch.float32, trainable: str = "all", *,
                         with_teacher: bool = True, lora: dict | None = None):
    """(student, teacher): the student trains ``mode`` attention; the teacher is a frozen deep copy with the
    reference mode's attention in the same layers, cast to ``teacher_dtype`` (None when ``with_teacher`` is
    false). ``trainable="attention"`` leaves only the patched attention modules' weights trainable.
    ``trainable="lora"``: the transformer is frozen as it is (its dtype is the teacher's) and a LoRA adapter
    (``lora``: :func:`~attnqat.pipelines.lora.add_lora`'s keywords) is what trains; the teacher is an
    :class:`AdapterOffTeacher` of the student."""
    if trainable == "lora":
        student = transformer.train()
        names = patch_for_training(student, mode, layers, **(options or {}))
        add_lora(student, **lora)
        return student, AdapterOffTeacher(student, names) if with_teacher else None
    # copied before the student is patched: the copy starts from diffusers' processors
    teacher = make_teacher(cast_copy(transformer, teacher_dtype), layers) if with_teacher else None
    student = transformer.train().requires_grad_(True)
    names = patch_for_training(student, mode, layers, **(options or {}))
    if trainable == "attention":
        student.requires_grad_(False)
        for name in names:
            student.get_submodule(name).requires_grad_(True)
    return student, teacher


def make_teacher(transformer: torch.nn.Module, layers="self") -> torch.nn.Module:
    """The frozen teacher of :func:`make_student_teacher` made of ``transformer`` itself (unpatched, in the teacher's
    dtype): eval, no gradients, the reference mode's attention in ``layers``."""
    teacher = transformer.eval().requires_grad_(False)
    patch_for_training(teacher, REFERENCE_MODE, layers)
    return teacher


SHARD_TEACHER = ("auto", "on", "off")


def teacher_is_sharded(setting: str, fsdp_version: int | None) -> bool:
    """Whether a run shards its teacher copy (``train.shard_teacher``: auto, on, off) under ``fsdp_version`` (1, 2, or
    None without FSDP): auto and on under FSDP. ``on`` without FSDP is a one-line ValueError. (A LoRA run's teacher is
    the student's own module: sharded as the student is, whatever this says.)"""
    if setting == "on" and fsdp_version is None:
        raise ValueError("train.shard_teacher 'on' needs FSDP (accelerate launch --config_file "
                         "configs/fsdp_wan14b.yaml or fsdp2_wan14b.yaml): without it nothing shards the student "
                         "either; use 'auto' or 'off'")
    return setting != "off" and fsdp_version is not None


def shard_teacher(teacher: torch.nn.Module, like: torch.nn.Module, device: torch.device, *,
                  param_init_fn=None) -> torch.nn.Module:
    """The frozen teacher sharded over the processes that FSDP shards the student ``like`` over, with the same
    flavour (FSDP2's ``fully_shard``, or FSDP1's FULL_SHARD wrapper) and units (one per ``WanTransformerBlock``, one
    for the rest), each resharded after its forward (no backward comes to reuse the weights): a process holds 1/N
    of the teacher between forwards, and one unit gathered at a time during one. No mixed-precision policy: the
    weights are already in ``train.teacher_dtype`` and are gathered as they are, so the outputs and block features
    are the replicated teacher's. The units move to ``device`` one at a time as they are sharded: the whole teacher
    is never there. Call it after patch_attention and sequence parallelism, as for the student (their hooks sit in
    the modules' ``forward``, which FSDP calls).

    Arguments:
        teacher: the teacher, on the CPU (or the meta device: FSDP1 with ``param_init_fn``, FSDP2 then ``to_empty``).
        like: the student as FSDP prepared it: its mesh (FSDP2) or process group (FSDP1) is the teacher's.
        device: this process's device.
    Return:
        the module to call: ``teacher`` itself, sharded in place (FSDP2), or its FSDP1 wrapper.
    """
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, ShardingStrategy, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.tensor import DTensor

    if isinstance(like, FSDPModule):
        mesh = next(p.device_mesh for p in like.parameters() if isinstance(p, DTensor))
        for block in [m for m in teacher.modules() if isinstance(m, WanTransformerBlock)]:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        # given, not left to FSDP2's default: that keeps the root unit (embeddings, head) gathered after the forward,
        # for the backward a teacher never runs
        fully_shard(teacher, mesh=mesh, reshard_after_forward=True)
        return teacher
    if isinstance(like, FullyShardedDataParallel):
        return FullyShardedDataParallel(teacher, process_group=like.process_group, device_id=device,
                                        auto_wrap_policy=ModuleWrapPolicy({WanTransformerBlock}),
                                        sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True,
                                        param_init_fn=param_init_fn)
    raise TypeError(f"the student is not sharded by FSDP ({type(like).__name__}): there is nothing to shard the "
                    f"teacher like")


# The forward ops whose outputs a trainable attention mode's backward reads: attnqat's training forwards
# (attn_qat and attn_qat_dropin: attn_qat_fwd; attn_qat on an H100 / H200 with Gluon: attn_qat_fwd_sm90; sagebwd:
# sagebwd_fwd) and torch's SDPA backends (bf16 runs one, and so do the layers left unpatched, such as the
# cross-attention: block_checkpoint(save_attention=True) keeps an SDPA call only where it attends to as many keys as it has
# queries). Not the inference-only forwards (fp4_fwd_sm90, sage3_fwd: never under grad), nor
# aten::_scaled_dot_product_attention_math_for_mps, whose second output is the whole L x L probability matrix.
SAVED_ATTENTION_OPS = ("attnqat::attn_qat_fwd", "attnqat::attn_qat_fwd_sm90", "attnqat::sagebwd_fwd",
                       "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
                       "aten::_scaled_dot_product_cudnn_attention",
                       "aten::_scaled_dot_product_flash_attention_for_cpu",
                       "aten::_scaled_dot_product_fused_attention_overrideable", "aten::_flash_attention_forward",
                       "aten::_efficient_attention_forward")


def saved_attention_ops() -> list[torch._ops.OpOverload]:
    """Every overload of each op in :data:`SAVED_ATTENTION_OPS` that this torch has (an SDPA backend a build lacks
    is skipped)."""
    ops = []
    for qualified in SAVED_ATTENTION_OPS:
        namespace, name = qualified.split("::")
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None:
            ops += [getattr(packet, overload) for overload in packet.overloads()]
    return ops


def block_checkpoint(save_attention: bool = False):
    """The student's gradient-checkpointing function for diffusers (``model.enable_gradient_checkpointing(it)``;
    diffusers calls it as ``func(block, *args)``): torch's non-reentrant checkpoint of each block, as diffusers' own.

    With ``save_attention`` (``train.save_attention``) it adds selective activation checkpointing: the backward's
    recompute of a block takes the outputs of its :func:`saved_attention_ops` calls from the forward and reruns
    everything else. The gradients are the same (bit for bit in tests/test_save_attention.py, on CPU); the attention
    forward runs once a step instead of twice, at the memory of those outputs, held from each block's forward to its
    backward (docs/training.md). An SDPA call over fewer keys than queries (Wan's cross-attention: 512 text tokens)
    is rerun instead: its outputs would cost as much memory as the self-attention's for about 1/64 of its time at
    480p.

    A block under FSDP2 gets its inputs cast as :func:`fsdp_cast_inputs` says before the checkpoint saves them."""
    # Without save_attention, the forward's saved tensors are thrown away and recomputed: attn_qat's forward then runs
    # its inference kernel and saves placeholders (kernels._common.saved_tensors_recomputed), the recompute the
    # training kernel that the backward needs (the same gradients, bit for bit: tests/test_save_attention.py)
    context = {"context_fn": lambda: (saved_tensors_recomputed(), nullcontext())}
    if save_attention:
        kept = set(saved_attention_ops())
        # torch's ops take (query, key, ...): (B, H, L, D) for the _scaled_dot_product_* ones, (B, L, H, D) for others
        seq_dim = {op: -2 if op._schema.name.startswith("aten::_scaled_dot_product") else 1
                   for op in kept if op._schema.name.startswith("aten::")}

        def policy(ctx, op, *args, **kwargs):
            keep = op in kept and (op not in seq_dim or args[1].shape[seq_dim[op]] >= args[0].shape[seq_dim[op]])
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        context = {"context_fn": functools.partial(create_selective_checkpoint_contexts, policy)}

    def checkpointed(block, *args):
        return checkpoint(block.__call__, *fsdp_cast_inputs(block, args), use_reentrant=False, **context)

    checkpointed.saves_attention = save_attention  # which one a run got (tests read it)
    return checkpointed


def fsdp_cast_inputs(block: torch.nn.Module, args: tuple) -> tuple:
    """``args`` as FSDP2's pre-forward hook of ``block`` casts them (floating tensors to its mixed-precision policy's
    param_dtype), or as they are when ``block`` is no FSDP2 module or its policy casts nothing.

    Cast before the checkpoint, so that the checkpoint saves and the backward's recompute reruns the block on the
    same tensors. torch before 2.13 skips that cast when the backward reruns a block (pytorch#159359, fixed by
    pytorch#182580): Wan's rotary embedding (fp32) reached the forward in bf16 and the recompute in fp32, and the
    whole 14B step under FSDP2 with bf16 compute stopped in its first backward ("Recomputed values ... have
    different metadata", an H200 pair on torch 2.11). The values are the ones the hook would give: on a torch that
    casts in the recompute too, nothing changes."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not isinstance(block, FSDPModule):
        return args
    policy = getattr(fully_shard.state(block), "_mp_policy", None)
    dtype = getattr(policy, "param_dtype", None)
    if dtype is None or not getattr(policy, "cast_forward_inputs", False):
        return args
    return torch.utils._pytree.tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, args)


class FeatureCapture:
    """Forward hooks on every ``WanTransformerBlock`` of a transformer, recording output hidden states.

    Only records while :meth:`capturing` is active, so the recomputation of gradient checkpointing
    during backward adds nothing (and keeps nothing alive).
    """

    def __init__(self, transformer: torch.nn.Module):
        self.features: dict[int, torch.Tensor] = {}
        self._on = False
        blocks = [m for m in transformer.modules() if isinstance(m, WanTransformerBlock)]
        if not blocks:
            raise TypeError(f"no WanTransformerBlock in {type(transformer).__name__}")
        self._handles = [b.register_forward_hook(self._hook(i)) for i, b in enumerate(blocks)]

    def _hook(self, i):
        def hook(module, args, output):
            if self._on:
                self.features[i] = output
        return hook

    @contextmanager
    def capturing(self):
        self.features = {}
        self._on = True
        try:
            yield self.features
        finally:
            self._on = False

    def remove(self):
        for h in self._handles:
            h.remove()
