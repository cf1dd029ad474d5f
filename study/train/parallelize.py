"""How a built model is laid out to train on this job's devices: FSDP2 sharding, activation checkpointing,
torch.compile, and the precision its forward passes compute in. The loop builds the model, hands it to
`parallelize`, and never decides any of this itself."""

from __future__ import annotations

from study.config.run import RunConfig
from study.train.distributed import Dist


def parallelize(model, cfg: RunConfig, d: Dist):
    """The model sharded over the ranks when there are several, each block's activations recomputed in the backward
    pass with `train.activation_checkpointing`, and each block compiled with `train.compile` (unset: on CUDA only).

    Sharding comes first so that `fully_shard` is handed the blocks themselves (`model.layers`), not their
    recomputation wrappers; compile comes last (`compile_blocks`)."""
    if d.world_size > 1:
        model = wrap_fsdp(model, cfg, d)
    if cfg.train.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        from study.models.transformer import Block

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    if d.device.startswith("cuda") if cfg.train.compile is None else cfg.train.compile:
        compile_blocks(model)
    return model


def blocks(model) -> list:
    """The model's blocks themselves, inside any recomputation wrapper."""
    return [getattr(layer, "_checkpoint_wrapped_module", layer) for layer in model.layers]


def compile_blocks(model, backend: str = "inductor") -> None:
    """Each block's forward compiled whole (`fullgraph`: a graph break is an error, not a silent split), as torchtitan
    lays a model out: FSDP2's hooks, which dynamo does not trace (a compiled sharded model breaks its graph at each),
    and the recomputation wrapper run around the graphs; the embedding, final norm and head run eagerly."""
    import torch

    for block in blocks(model):
        block.forward = torch.compile(block.forward, fullgraph=True, backend=backend)


def sharding(cfg: RunConfig, d: Dist) -> str:
    """`train.sharding` resolved for this job: `full` or `hybrid` (`auto`: hybrid across nodes, full on one)."""
    s = cfg.train.sharding
    return ("hybrid" if d.nodes > 1 else "full") if s == "auto" else s


def layout_name(cfg: RunConfig, d: Dist) -> str:
    """How this job lays the run out, in words: '2 nodes x 1 rank, hybrid'."""
    nodes, per = d.nodes, d.ranks_per_node
    head = f"{nodes} node{'s' * (nodes > 1)} x {per} rank{'s' * (per > 1)}"
    return f"{head}, {sharding(cfg, d) if d.world_size > 1 else 'unsharded'}"


def wrap_fsdp(model, cfg: RunConfig, d: Dist):
    """FSDP2 sharding every block, then the root (embedding, final norm, head), in bf16 when `use_bf16`. The mesh is
    1-D over every rank (full), or 2-D for hybrid, where `fully_shard` is HSDP: each block's parameters sharded over
    the ranks of a node and replicated across nodes."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = "cuda" if d.device.startswith("cuda") else "cpu"
    if sharding(cfg, d) == "hybrid":
        mesh = init_device_mesh(device, (d.nodes, d.ranks_per_node), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device, (d.world_size,), mesh_dim_names=("shard",))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mp = bf16 if use_bf16(cfg, d) else MixedPrecisionPolicy()  # the default: compute in the parameters' fp32
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def use_bf16(cfg: RunConfig, d: Dist) -> bool:
    """`train.precision`: bf16 when asked, or `auto` on CUDA."""
    p = cfg.train.precision
    return p == "bf16" or (p == "auto" and d.device.startswith("cuda"))


def autocast_bf16(cfg: RunConfig, d: Dist) -> bool:
    """Whether the step autocasts to bf16 itself: only on one process, since FSDP's policy casts sharded runs."""
    return use_bf16(cfg, d) and d.world_size == 1


def compute_dtype(cfg: RunConfig, d: Dist) -> str:
    """What the forward passes compute in: bf16 under FSDP's policy or CUDA autocast (the step's only), else fp32."""
    bf16 = use_bf16(cfg, d) and (d.world_size > 1 or d.device.startswith("cuda"))
    return "bfloat16" if bf16 else "float32"
