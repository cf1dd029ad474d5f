"""How a built model is laid out to train on this job's devices: FSDP2 sharding, activation checkpointing,
torch.compile, and the precision its forward passes compute in. The loop builds the model, hands it to
`parallelize`, and never decides any of this itself."""

from __future__ import annotations

from study.config.run import RunConfig
from study.train.distributed import Dist


def parallelize(model, cfg: RunConfig, d: Dist):
    """(model, step_model): the model sharded over the ranks when there are several, its blocks' activations
    recomputed in the backward pass when asked, and the callable the batches go through (compiled when
    `use_compile`). `model` owns the parameters (optimizer, checkpoints); `step_model` runs the forward passes.

    Sharding comes first so that `fully_shard` is handed the blocks themselves (`model.layers`), not their
    recomputation wrappers; compile comes last so that it traces the finished module."""
    import torch

    if d.world_size > 1:
        model = wrap_fsdp(model, cfg, d)
    if cfg.train.activation_checkpointing:
        checkpoint_blocks(model)
    step_model = torch.compile(model) if use_compile(cfg, d) else model
    return model, step_model


def wrap_fsdp(model, cfg: RunConfig, d: Dist):
    """FSDP2: shard every block, then the root (embedding, final norm, head); bf16 compute on CUDA only."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if use_bf16(cfg, d) else None
    kwargs = {"mp_policy": mp} if mp else {}
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def checkpoint_blocks(model) -> None:
    """Recompute each transformer block's activations in the backward pass instead of keeping them."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from study.models.transformer import Block

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))


def use_compile(cfg: RunConfig, d: Dist) -> bool:
    """`train.compile`; unset, on CUDA only."""
    c = cfg.train.compile
    return d.device.startswith("cuda") if c is None else bool(c)


def use_bf16(cfg: RunConfig, d: Dist) -> bool:
    """`train.precision`: bf16 when asked, or `auto` on CUDA."""
    p = cfg.train.precision
    return p == "bf16" or (p == "auto" and d.device.startswith("cuda"))


def autocast_bf16(cfg: RunConfig, d: Dist) -> bool:
    """Whether the step autocasts to bf16 itself: only on one process, since FSDP's policy casts sharded runs."""
    return use_bf16(cfg, d) and d.world_size == 1


def compute_dtype(cfg: RunConfig, d: Dist) -> str:
    """What the run's forward passes compute in: bf16 under FSDP's policy or CUDA autocast (the only autocast the
    step enables), else fp32."""
    bf16 = use_bf16(cfg, d) and (d.world_size > 1 or d.device.startswith("cuda"))
    return "bfloat16" if bf16 else "float32"
