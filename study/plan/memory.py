"""Memory per rank of one training step, estimated from the config alone (no torch), and the checks built on it.

The step study.train runs is modelled tensor by tensor, in eager mode: fp32 parameters, gradients and AdamW's two
states, sharded by FSDP2 over the run's shard group (each tensor padded on its first dimension) or whole on one rank;
the compute copies FSDP2 gathers around each block (the root's stay gathered through the backward) or CUDA autocast
caches on one rank; the gradient shards an accumulated step holds between micro-batches; and what autograd keeps of
one micro-batch (only each block's input under activation checkpointing). The peak is the largest of the backward's
phases: its start, each block's backward and its end. tests/test_memory.py holds the estimate within 10 % of torch's
tracked peak for every block and FFN at tiny sizes. Not modelled: the CUDA allocator's rounding and fragmentation,
the CUDA context and NCCL buffers (`HEADROOM` is for those), and what torch.compile saves (on CUDA the estimate errs
high).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from pathlib import Path

from study.config.model import ModelConfig
from study.config.run import RunConfig
from study.config.spec import RunSpec
from study.errors import StudyError

GIB = 2**30
HEADROOM = 0.10
"""Share of the device's memory `train.micro_batch: auto` leaves free for what the estimate does not count."""


@dataclass(frozen=True)
class Layout:
    """How one job executes a run's step, as far as memory goes."""

    world: int
    """Ranks of the job."""
    nodes: int
    """Hosts the ranks run on."""
    micro_batch: int
    """Sequences per rank per forward pass."""
    grad_accum: int
    """Micro-batches per optimizer step."""
    cuda: bool
    """On GPUs (else CPU ranks)."""
    bf16: bool
    """Mixed precision: bf16 compute copies of fp32 parameters (FSDP2's policy, or CUDA autocast on one rank)."""
    sharding: str
    """`train.sharding`: `full`, `hybrid` or `auto` (hybrid across nodes, as study.train.parallelize resolves it)."""
    checkpointing: bool
    """Each block's activations are recomputed in the backward."""

    @property
    def per_node(self) -> int:
        """Ranks on each node."""
        return self.world // self.nodes

    @property
    def shard(self) -> int:
        """Ranks each parameter is split over: none on one rank, a node's ranks under hybrid, else every rank."""
        if self.world == 1:
            return 1
        hybrid = self.sharding == "hybrid" or (self.sharding == "auto" and self.nodes > 1)
        return self.per_node if hybrid else self.world


def planned_layout(cfg: RunConfig, micro_batch: int, grad_accum: int, world: int | None = None,
                   cuda: bool | None = None) -> Layout:
    """The layout a run trains at: its cluster's, or `world` ranks on one node (`study train --nproc`)."""
    c, t = cfg.cluster, cfg.train
    nodes = c.nodes if world is None else 1
    world = c.ranks if world is None else world
    if cuda is None:
        cuda = t.device == "cuda" or (t.device == "auto" and c.gpus_per_node > 0)
    # as study.train.parallelize decides: bf16 when asked or auto on CUDA; it computes so on CUDA or under FSDP
    bf16 = (t.precision == "bf16" or (t.precision == "auto" and cuda)) and (world > 1 or cuda)
    return Layout(world, nodes, micro_batch, grad_accum, cuda, bf16, t.sharding, t.activation_checkpointing)


@dataclass(frozen=True)
class Memory:
    """One run's estimated memory per rank, in bytes (`as_json` gives GiB)."""

    params: int
    """Parameters and buffers: the fp32 shards, and the compute copies gathered at the peak."""
    grads: int
    """Gradients held at the peak: the sharded fp32 ones."""
    optimizer: int
    """AdamW's states."""
    activations: int
    """What one micro-batch's forward keeps for the backward."""
    peak: int
    """The largest total of the step (the parts peak at different moments, so not their sum)."""
    device: int | None
    """The device's memory (a CPU rank: its share of the host's); None when the cluster does not say."""
    layout: Layout
    """The layout estimated."""

    @property
    def fits(self) -> bool | None:
        """Whether the peak fits the device; None when the device's memory is not known."""
        return None if self.device is None else self.peak <= self.device

    def as_json(self) -> dict:
        """`study plan --json`'s `memory` object: GiB per rank."""
        gib = {k: round(getattr(self, k) / GIB, 3) for k in ("params", "grads", "optimizer", "activations", "peak")}
        return {**gib, "device": None if self.device is None else round(self.device / GIB, 3), "fits": self.fits}

    def text(self) -> str:
        """The plan's cell, GiB per rank against the device's: `61.2/80`, marked when it does not fit."""
        device = "?" if self.device is None else f"{self.device / GIB:.3g}"
        return f"{self.peak / GIB:.3g}/{device}" + (" (too big)" if self.fits is False else "")


# --- the model's tensors ---------------------------------------------------------------------------------------


def _root_tensors(m: ModelConfig) -> list[tuple[int, int]]:
    """(first dimension, elements) of the root module's own parameters: embedding, final norm, untied LM head."""
    out = [(m.vocab_size, m.vocab_size * m.d_model), (m.d_model, m.d_model)]
    return out if m.tie_embeddings else out + [(m.vocab_size, m.vocab_size * m.d_model)]


def _block_tensors(m: ModelConfig, layer: int) -> list[tuple[int, int]]:
    """(first dimension, elements) of block `layer`'s parameters, as study.models builds them."""
    d, hd = m.d_model, m.dim_head
    q, kv = m.q_heads(layer) * hd, m.kv_heads_of(layer) * hd
    out = [(q, q * d), (kv, kv * d), (kv, kv * d), (d, d * q), (d, d)]  # attention and its sublayer's norm
    if m.has_qk_norm:
        out += [(q, q), (kv, kv)]
    for w in _hidden(m, layer):
        out += [(w, w * d), (w, w * d), (d, d * w)]
        if m.ffn.kind == "hourglass" and m.ffn.sub_norm:
            out.append((d, d))
    if not m.hourglass_on_stream:
        out.append((d, d))  # the FFN sublayer's norm
    return out


def _hidden(m: ModelConfig, layer: int) -> list[int]:
    """Hidden widths of block `layer`'s FFN: one per hourglass sub-MLP, else the SwiGLU's one."""
    return m.sub_widths(layer) if m.ffn.kind == "hourglass" else [m.ffn.widths[layer]]


def _sharded(tensors: list[tuple[int, int]], shard: int) -> int:
    """Elements one rank holds of `tensors` split over `shard` ranks on their first dimension (padded to it)."""
    return sum(math.ceil(rows / shard) * (n // rows) for rows, n in tensors)


def parameter_count(m: ModelConfig) -> int:
    """Every parameter the model builds (tests hold it to study.plan.budget.count_params)."""
    return sum(n for _, n in _root_tensors(m)) + sum(n for l in range(m.n_layers) for _, n in _block_tensors(m, l))


# --- what autograd keeps ---------------------------------------------------------------------------------------


def _norm(tokens: int, width: int, c: int, output_saved: bool, fused: bool) -> int:
    """Bytes an RMSNorm keeps: its input and reciprocal rms (CUDA's fused kernel; elsewhere the input in fp32 and the
    fp32 normalised input too), and its output when a linear consumes it."""
    kept = c * width + 4 if fused else 4 * width + 4 + 4 * width
    return tokens * (kept + (c * width if output_saved else 0))


def block_activations(m: ModelConfig, layer: int, batch: int, seq: int, c: int, cuda: bool = False) -> int:
    """Bytes block `layer` keeps for the backward from `batch` x `seq` tokens computing in `c` bytes (its input
    stream counted by whoever keeps it)."""
    tokens, d, hd = batch * seq, m.d_model, m.dim_head

    def norm(width: int, output_saved: bool) -> int:
        return _norm(tokens, width, c, output_saved, cuda)

    heads = m.q_heads(layer)
    q, kv = heads * hd, m.kv_heads_of(layer) * hd
    post = m.block == "olmo2"
    out = c * tokens * d if post else norm(d, True)  # the projections' input
    if m.has_qk_norm:
        out += norm(q, False) + norm(kv, False)
    out += c * tokens * (2 * q + 2 * kv) + 4 * batch * heads * seq  # rotated q, k; v; SDPA's output and log-sum-exp
    if c != 4:
        out += 4 * seq * hd * c  # the fp32 RoPE tables cast to the compute dtype, for q and k
    if post:
        out += norm(d, False)  # on the attention's output
    sub_norm = m.ffn.kind == "hourglass" and m.ffn.sub_norm
    if post:
        out += 0 if sub_norm else c * tokens * d  # the stream, kept by the first linears
    elif not m.hourglass_on_stream:
        out += norm(d, not sub_norm)  # the block's pre-norm (its output feeds the sub-norm, if any)
    for i, w in enumerate(_hidden(m, layer)):
        if sub_norm:
            out += norm(d, True)
        elif i > 0:
            out += c * tokens * d  # h_i, kept by the sub-MLP's first linears
        out += 4 * c * tokens * w  # W_1 x, W_2 x, SiLU(W_1 x), their product
    if post:
        out += norm(d, False)  # on the FFN's output
    return out


def head_activations(m: ModelConfig, batch: int, seq: int, c: int, z_loss: bool, cuda: bool = False) -> int:
    """Bytes the embedding, final norm and loss keep: token ids, the final norm, the fp32 log-softmax of the logits
    (and with a z-loss the fp32 logits and their log-sum-exp)."""
    tokens = batch * seq
    out = 8 * tokens + _norm(tokens, m.d_model, c, True, cuda) + 4 * tokens * m.vocab_size
    return out + (4 * tokens * m.vocab_size + 8 * tokens if z_loss else 0)


# --- the step ----------------------------------------------------------------------------------------------------


def estimate(m: ModelConfig, seq_len: int, layout: Layout, z_loss: bool = False, device: int | None = None
             ) -> Memory:
    """The memory per rank of one steady-state training step of model `m` (every width set) at `layout`."""
    s, c, fsdp = layout.shard, 2 if layout.bf16 else 4, layout.world > 1
    tokens, d, v = layout.micro_batch * seq_len, m.d_model, m.vocab_size
    root = _root_tensors(m)
    blocks = [_block_tensors(m, l) for l in range(m.n_layers)]
    root_shard, block_shards = _sharded(root, s), [_sharded(blk, s) for blk in blocks]
    root_whole, block_whole = root_shard * s, [n * s for n in block_shards]  # gathered whole, with the padding
    sharded_grads = 4 * (root_shard + sum(block_shards))  # fp32, as the parameters
    params = sharded_grads + 2 * 4 * m.max_seq_len * m.dim_head  # and the RoPE tables
    optimizer = 2 * sharded_grads + 4 * (len(root) + sum(map(len, blocks)))
    if fsdp:  # the root's compute copy stays gathered from its forward to the end of the backward
        gathered = c * root_whole
    elif layout.bf16:  # autocast's cached bf16 copy of every matrix a linear reads (the LM head's, tied or not)
        gathered = 2 * (sum(n for blk in blocks for rows, n in blk if n != rows) + v * d)
    else:
        gathered = 0
    # an accumulated step holds every gradient between its micro-batches: each micro-batch reduce-scatters its own
    # into the sharded fp32 ones (one rank: the whole ones autograd accumulates into)
    held = sharded_grads if layout.grad_accum > 1 else 0

    stream = c * tokens * d
    own = [block_activations(m, l, layout.micro_batch, seq_len, c, layout.cuda) for l in range(m.n_layers)]
    kept = [stream if layout.checkpointing else a for a in own]
    activations = head_activations(m, layout.micro_batch, seq_len, c, z_loss, layout.cuda) + sum(kept)

    # the backward's start: every activation and the loss's fp32 logit-sized gradients (three with a z-loss)
    phases = [held + activations + (3 if z_loss else 2) * 4 * tokens * v]
    # each block's backward, from the top: the gradients above it (or every held one), the activations below it, its
    # own activations (recomputed under checkpointing), the stream's gradient, the largest hidden gradients; under
    # FSDP2 its gathered copy, the next block's prefetched one and its gradients' reduce-scatter input
    grads = (c if fsdp else 4) * (v * d + d)  # the LM head's and final norm's (FSDP2: whole, until the root reduces)
    # with held gradients: those, and under FSDP2 the root's whole ones (one rank: accumulated into the held ones)
    accumulating = held + (grads if fsdp else 0)
    below = 8 * tokens + sum(kept)
    for l in reversed(range(m.n_layers)):
        below -= kept[l]
        transient = own[l] + 2 * stream + 2 * c * tokens * max(*_hidden(m, l), d)
        if fsdp:
            transient += (2 * c + 4) * block_whole[l]
        phases.append((accumulating if held else grads) + below + transient)
        grads += 4 * (block_shards[l] if fsdp else sum(n for _, n in blocks[l]))
    # the backward's end: every gradient and the embedding's (accumulated into a held or tied one: a second copy);
    # under FSDP2 the root's whole gradients, their reduce-scatter input and output (the held shards beside it)
    if fsdp:
        end = (c + 4) * root_whole + 4 * root_shard + (sharded_grads if held else 4 * sum(block_shards))
    else:
        end = sharded_grads + (4 * v * d if held or m.tie_embeddings else 0)
    phases.append(end + 8 * tokens + stream)
    peak = params + optimizer + gathered + max(phases)
    if fsdp:
        gathered += c * max(block_whole)  # one block's copy at a time
    return Memory(params=params + gathered, grads=sharded_grads, optimizer=optimizer, activations=activations,
                  peak=peak, device=device, layout=layout)


# --- a run's device and layout -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def host_memory() -> int:
    """This machine's memory in bytes: physical, or its cgroup's limit where that is lower (a container's)."""
    import psutil

    total = psutil.virtual_memory().total
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            total = min(total, int(Path(path).read_text()))
        except (OSError, ValueError):  # no such cgroup, or no limit ("max")
            continue
    return total


def device_memory(cfg: RunConfig, layout: Layout) -> tuple[int | None, str]:
    """Bytes one rank may use, and where that figure comes from in words: its GPU's (`cluster.gpu_mem_gb`; None when
    the cluster does not say), or a CPU rank's share of its host's (`cluster.mem_gb` per node, else this machine's)."""
    c = cfg.cluster
    if layout.cuda:
        return (round(c.gpu_mem_gb * GIB) if c.gpu_mem_gb else None,
                f"cluster {c.name}: cluster.gpu_mem_gb={c.gpu_mem_gb:g}" + (f" ({c.gpu})" if c.gpu else ""))
    host, source = ((c.mem_gb * GIB, f"cluster.mem_gb={c.mem_gb}") if c.mem_gb
                    else (host_memory(), "this machine's memory"))
    return host // max(1, layout.per_node), source + (f" shared by {layout.per_node} ranks" * (layout.per_node > 1))


def estimable(m: ModelConfig, budget: int, mode: str) -> ModelConfig:
    """`m`, or for a geometry-scheduled model awaiting its profile, its budget's FFN total spread evenly over the
    layers (activations follow the total width, which the allocation keeps)."""
    if m.ffn.widths is not None:
        return m
    from study.plan.budget import ffn_units, with_widths

    total = max(m.n_layers * m.ffn.k, ffn_units(m, budget, mode)[1])
    return with_widths(m, [total // m.n_layers + (l < total % m.n_layers) for l in range(m.n_layers)])


def _model(spec: RunSpec) -> ModelConfig:
    """The model a spec's memory is estimated for (`estimable`)."""
    return estimable(spec.model, spec.budget, spec.config.budget.mode)


def run_memory(spec: RunSpec, layout: Layout | None = None, device: int | None = None) -> Memory:
    """The spec's memory per rank at `layout` on a device of `device` bytes (defaults: the planned ones)."""
    cfg, r = spec.config, spec.planned
    layout = layout or planned_layout(cfg, r.micro_batch, r.grad_accum)
    device = device if device is not None else device_memory(cfg, layout)[0]
    return estimate(_model(spec), cfg.data.seq_len, layout, bool(cfg.train.z_loss), device)


def memories(plan) -> dict[str, Memory]:
    """run key -> its memory per rank at its planned layout (`study plan`, `study plan --json`)."""
    return {run.key: run_memory(run) for run in plan.runs}


# --- train.micro_batch: auto ---------------------------------------------------------------------------------------


def largest_fit(spec_model: ModelConfig, cfg: RunConfig, layout: Layout, limit: float) -> Layout | None:
    """`layout` at the largest micro batch dividing its rank's share of the step whose estimated peak is at most
    `limit` bytes; None when not even one sequence at a time is."""
    share = layout.micro_batch * layout.grad_accum
    for micro in (m for m in range(share, 0, -1) if share % m == 0):
        at = replace(layout, micro_batch=micro, grad_accum=share // micro)
        if estimate(spec_model, cfg.data.seq_len, at, bool(cfg.train.z_loss)).peak <= limit:
            return at
    return None


def fit_micro_batch(cfg: RunConfig, model: ModelConfig, global_batch: int) -> tuple[int, int]:
    """(micro batch, accumulation steps) of `train.micro_batch: auto`: the largest fit leaving `HEADROOM` free (1
    when none does: the launch then refuses the run, naming what would fit)."""
    share = global_batch // cfg.cluster.ranks
    layout = planned_layout(cfg, share, 1)
    device = device_memory(cfg, layout)[0]
    if device is None:
        raise StudyError("cluster.gpu_mem_gb", f"train.micro_batch=auto needs the memory of cluster {cfg.cluster.name}"
                         "'s GPUs, which its preset does not give", "set cluster.gpu_mem_gb (80 for an H100 80GB, "
                         "40 or 80 for an A100, 141 for an H200), or give train.micro_batch a number")
    fitted = largest_fit(model, cfg, layout, (1 - HEADROOM) * device)
    return (fitted.micro_batch, fitted.grad_accum) if fitted else (1, share)


def auto_choices(runs: list[RunSpec], memory: dict[str, Memory]) -> list[str]:
    """`study plan`'s lines naming what `train.micro_batch: auto` chose, one per variant and scale."""
    out: dict[tuple[str, str], str] = {}
    for run in (run for run in runs if run.config.train.micro_batch_auto):
        r, mem, c = run.planned, memory[run.key], run.config
        out.setdefault((c.variant, c.scale), f"train.micro_batch=auto: {c.variant} at {c.scale} trains micro-batches "
                       f"of {r.micro_batch} x {r.grad_accum} per rank (global batch {r.global_batch}), estimated peak "
                       f"{_gib(mem.peak)} of {_gib(mem.device)}, {HEADROOM:.0%} kept free")
    return list(out.values())


# --- the refusal --------------------------------------------------------------------------------------------------


def _gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB"


def _more_nodes(spec: RunSpec, layout: Layout, factor: int) -> Layout | None:
    """`layout` on `factor` times the nodes, its global batch split over the ranks as the planner splits it."""
    from study.config.recipe import batch_layout

    world, nodes, r = layout.world * factor, layout.nodes * factor, spec.planned
    if r.global_batch % world:
        return None
    micro, accum = batch_layout(r.global_batch, spec.config.train.micro_batch, world)
    return replace(layout, world=world, nodes=nodes, micro_batch=micro, grad_accum=accum)


def _fixes(unfit: list[tuple[RunSpec, Memory]], nodes: bool) -> list[str]:
    """The settings that would make every run of `unfit` fit, each with the largest peak it leaves: micro-batch auto,
    activation checkpointing, more nodes (where `nodes` allows), or the first two together when neither suffices."""
    def fits_all(change) -> list[Memory] | None:
        layouts = [change(spec, mem) for spec, mem in unfit]
        if None in layouts:
            return None
        out = [run_memory(spec, layout, mem.device) for (spec, mem), layout in zip(unfit, layouts)]
        return out if all(m.fits for m in out) else None

    def auto(spec: RunSpec, mem: Memory, layout: Layout | None = None) -> Layout | None:
        return largest_fit(_model(spec), spec.config, layout or mem.layout, (1 - HEADROOM) * mem.device)

    def checkpointed(spec: RunSpec, mem: Memory) -> Layout:
        return replace(mem.layout, checkpointing=True)

    def peak(mems: list[Memory]) -> str:
        return f"at most {_gib(max(m.peak for m in mems))}"

    out = []
    if (mems := fits_all(auto)) is not None:
        micro = ", ".join(map(str, sorted({m.layout.micro_batch for m in mems})))
        out.append(f"train.micro_batch=auto (micro-batch {micro}, the global batch and so the run keys unchanged: "
                   f"{peak(mems)})")
    ready = unfit[0][1].layout.checkpointing
    if not ready and (mems := fits_all(checkpointed)) is not None:
        out.append(f"train.activation_checkpointing=true ({peak(mems)})")
    for factor in (2, 4, 8, 16) if nodes else ():
        if (mems := fits_all(lambda s, m: _more_nodes(s, m.layout, factor))) is not None:
            out.append(f"cluster.nodes={unfit[0][1].layout.nodes * factor} ({peak(mems)})")
            break
    if not out and not ready and (mems := fits_all(lambda s, m: auto(s, m, checkpointed(s, m)))) is not None:
        out.append(f"train.micro_batch=auto train.activation_checkpointing=true ({peak(mems)})")
    return out


def check_fits(runs: list[tuple[RunSpec, Memory]], where: str, nodes: bool, outcome: str) -> None:
    """Refuse (naming the estimate, `where` the memory is and what would fit) every run that does not fit its device;
    `outcome` says what was therefore not done, `nodes` whether a job can have more nodes."""
    unfit = [(spec, mem) for spec, mem in runs if mem.fits is False]
    if not unfit:
        return
    worst = max(unfit, key=lambda sm: sm[1].peak)[1]
    lay = worst.layout
    names = "; ".join(f"{s.name} ({s.key}) {_gib(m.peak)}" for s, m in unfit[:5]) + (
        f"; and {len(unfit) - 5} more" if len(unfit) > 5 else "")
    parts = (f"params {_gib(worst.params)}, grads {_gib(worst.grads)}, optimizer {_gib(worst.optimizer)}, "
             f"activations {_gib(worst.activations)}, and the backward's own gradients at its peak")
    layout = (f"{lay.nodes} node{'s' * (lay.nodes > 1)} x {lay.per_node} rank{'s' * (lay.per_node > 1)}, "
              f"{'bf16' if lay.bf16 else 'fp32'}, micro-batch {lay.micro_batch} x {lay.grad_accum}")
    fixes = _fixes(unfit, nodes)
    raise StudyError(
        f"run {unfit[0][0].name}" if len(unfit) == 1 else f"{len(unfit)} runs",
        f"the estimated peak memory per rank of a training step exceeds the device's {_gib(worst.device)} ({where}): "
        f"{names} (the largest: {parts}; at {layout}; study.plan.memory); {outcome}",
        ("set " + ", or ".join(fixes)) if fixes else
        f"neither a smaller micro-batch{', more nodes' if nodes else ''} nor activation checkpointing makes it fit: "
        "train a smaller shape, or on devices with more memory (cluster.gpu_mem_gb says how much a cluster's GPUs "
        "have)")


def check_launch(runs: list[RunSpec]) -> None:
    """`study launch`'s refusal: every run to submit must fit its device at its planned layout."""
    if runs:
        cfg = runs[0].config
        memories = [(r, run_memory(r)) for r in runs]
        check_fits(memories, device_memory(cfg, memories[0][1].layout)[1], nodes=cfg.cluster.name != "local",
                   outcome="nothing was submitted")


def check_here(spec: RunSpec, world: int) -> None:
    """`study train`'s refusal before it allocates anything: the run at `world` ranks on this machine's device."""
    import torch

    from study.train.distributed import Dist
    from study.train.loop import layout as split

    cuda = torch.cuda.is_available() and spec.config.train.device != "cpu"
    micro, accum = split(spec, Dist(0, world, 0, "cuda" if cuda else "cpu"))
    layout = planned_layout(spec.config, micro, accum, world=world, cuda=cuda)
    if cuda:
        memory, where = torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)
    else:
        memory, where = host_memory() // world, "this machine's memory" + (f" shared by {world} ranks" * (world > 1))
    check_fits([(spec, run_memory(spec, layout, memory))], where, nodes=False, outcome="nothing was allocated")
