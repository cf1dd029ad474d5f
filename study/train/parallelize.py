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


def sharding(cfg: RunConfig, d: Dist) -> str:
    """`train.sharding` resolved for this job: `full` or `hybrid` (`auto`: hybrid across nodes, full on one)."""
    s = cfg.train.sharding
    return ("hybrid" if d.nodes > 1 else "full") if s == "auto" else s


def layout_name(cfg: RunConfig, d: Dist) -> str:
    """How this job lays the run out, in words: '2 nodes x 1 rank, hybrid'."""
    nodes, per = d.nodes, d.ranks_per_node
    head = f"{nodes} node{'s' * (nodes > 1)} x {per} rank{'s' * (per > 1)}"
    return f"{head}, {sharding(cfg, d) if d.world_size > 1 else 'unsharded'}"


def device_mesh(cfg: RunConfig, d: Dist):
    """The mesh FSDP2 shards on: 1-D over every rank (full), or 2-D (replicate across nodes, shard within a node)."""
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if d.device.startswith("cuda") else "cpu"
    if sharding(cfg, d) == "hybrid":
        return init_device_mesh(device, (d.nodes, d.ranks_per_node), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device, (d.world_size,), mesh_dim_names=("shard",))


def wrap_fsdp(model, cfg: RunConfig, d: Dist):
    """FSDP2 on the run's mesh: shard every block, then the root (embedding, final norm, head); bf16 compute on CUDA
    only. On a 2-D mesh `fully_shard` is HSDP: each block's parameters are sharded over the ranks of a node and
    replicated across nodes."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if use_bf16(cfg, d) else None
    kwargs = {"mesh": device_mesh(cfg, d), **({"mp_policy": mp} if mp else {})}
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
