"""One training step of a run at its real shape without its hardware: the model built on fake tensors (shapes and
dtypes, no storage), laid out by `parallelize` as the run's job lays it out (FSDP2 over a 1-D mesh, or HSDP over
nodes x ranks) on a fake process group of the job's world size, then stepped by `train_step`: an 8-node 8B run
steps on a laptop. What it measures, as rank 0 of the job sees it:
- memory: torch's tracker (FSDPMemTracker; MemTracker on one rank) over one steady-state step, the optimizer's state
  already made by an untracked step, at the job's micro batch, sequence length, precision, activation checkpointing
  and accumulation. Two micro batches stand for any accumulation of two or more: from the second on, each meets the
  same state (the gradients the earlier ones left), so more reach no higher peak;
- FLOPs per token: FlopCounterMode over one forward and backward of the plain model on the meta device, attention
  through SDPA's math kernel so that it counts as its two matrix products (fused kernels count recomputed scores);
- graph breaks: torch._dynamo.explain of what a run compiles (`compile_blocks`: each block, whole), each distinct block
  once on the meta device, without compiling anything.

The step runs the CPU's kernels, eagerly, so the tracked peak is above what a GPU holds: CUDA's fused RMSNorm keeps
no fp32 copies of its input and a compiled step fuses more (study.plan.memory estimates both), and a one-rank bf16
run's CUDA autocast is not seen here (its activations count at fp32).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from enum import Enum

from study.config.model import ModelConfig
from study.config.run import RunConfig
from study.config.spec import RunSpec
from study.train.distributed import Dist
from study.train.parallelize import layout_name, use_bf16

GIB = 2**30
CODE = ("models/layers.py", "models/transformer.py", "train/optim.py", "train/parallelize.py", "train/preflight.py",
        "train/step.py")
"""The files of `study/` whose code a measurement runs: a result measured with other code is measured again."""


@dataclass(frozen=True)
class Measured:
    """What one fake step of a run's shape showed, per rank."""

    layout: str
    """How the job lays the run out, in words ('8 nodes x 8 ranks, hybrid')."""
    micro_batches: int
    """Micro batches the tracked step ran (two stand for any accumulation of two or more)."""
    peak_gib: float
    """The tracked peak of one steady-state step on rank 0, in GiB."""
    at_peak: dict[str, float]
    """What the memory held at that peak, by torch's categories (GiB)."""
    params_gib: float
    """The parameters the rank keeps between steps (its shard under FSDP), in GiB."""
    optimizer_gib: float
    """Its optimizer state between steps, in GiB."""
    flops_per_token: float
    """Training FLOPs per token torch counted over one forward and backward of the plain model."""
    graph_breaks: int | None
    """Graph breaks torch.compile's trace of the model met; None when not traced."""
    break_reasons: list[str]
    """Why, one line each."""
    seconds: dict[str, float]
    """Wall seconds of each phase here: `build` (build and shard), `step` (both steps), `flops`, `trace`."""


class StepFailed(Exception):
    """A run's model could not be built, sharded, stepped, counted or traced (`phase`); `error` is torch's words."""

    def __init__(self, phase: str, error: str):
        self.phase, self.error = phase, error
        super().__init__(f"cannot be {phase}: {error}")


MAX_ERROR = 600
"""Characters of an error's text a StepFailed keeps: torch's messages can run to pages."""


@contextmanager
def _phase(name: str) -> Iterator[None]:
    """Whatever goes wrong inside is a StepFailed of phase `name` (the error's own text, cut to one paragraph)."""
    try:
        yield
    except StepFailed:
        raise
    except Exception as err:  # noqa: BLE001 - torch's and the model's own errors, named for the user
        text = " ".join(str(err).split())
        raise StepFailed(name, f"{type(err).__name__}: {text[:MAX_ERROR]}{'...' if len(text) > MAX_ERROR else ''}"
                         ) from err


def job_dist(cfg: RunConfig, world_size: int) -> Dist:
    """Rank 0 of the run's job: `world_size` ranks on `cluster.nodes` hosts, on CUDA where the job's ranks are GPUs
    (`train.device=cuda`, or `auto` on a GPU profile)."""
    device = cfg.train.device
    cuda = device == "cuda" or (device == "auto" and cfg.cluster.gpus_per_node > 0)
    return Dist(0, world_size, 0, "cuda:0" if cuda else "cpu", max(1, cfg.cluster.nodes))


def stepped_config(cfg: RunConfig, job: Dist) -> RunConfig:
    """The config the fake step runs: the job's precision spelled out (the fake step runs on the CPU, where `auto`
    means fp32) and no compilation (the step is eager; the trace is checked on its own)."""
    precision = "bf16" if use_bf16(cfg, job) else "fp32"
    return replace(cfg, train=replace(cfg.train, precision=precision, compile=False))


@contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake process group of `world_size` ranks, this process its rank 0, for as long as the block runs."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the `fake` backend

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process; pre-flight makes its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Fresh(list):
    """The step's micro batches, each one after the first preceded by clearing the tracker's per-module records:
    torch's trackers refuse a second forward of the root module in one session, and their peak survives the
    clearing."""

    def __init__(self, batches: list, tracker):
        super().__init__(batches)
        self.tracker = tracker

    def __iter__(self):
        for i, batch in enumerate(super().__iter__()):
            if i:
                self.tracker.reset_mod_stats()
            yield batch


def peak_only(tracker: type) -> type:
    """`tracker` (torch's MemTracker or FSDPMemTracker) keeping the step's overall peak only. Its own bookkeeping
    also keeps each module's peak by walking every module it has met on every operator, which grows with the square
    of the model's module count (a 113M hourglass with 16 sub-MLPs per layer stepped in 310 s with it, 20 s
    without). The overall peak is updated as torch updates it."""

    class PeakOnly(tracker):
        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

    return PeakOnly


def _by_name(snapshot: dict) -> dict[str, int]:
    """A tracker snapshot of one device with its categories as their names ('Sharded Param', 'Total')."""
    return {k.value if isinstance(k, Enum) else str(k): int(v) for k, v in snapshot.items()}


def measure(spec: RunSpec, trace: bool = True) -> Measured:
    """Build, shard and step `spec`'s model at its real size over a fake group of its planned world size (and trace
    it, with `trace`). Raises StepFailed naming the phase that failed; the caller names the run."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from study.models.transformer import build_model
    from study.train.optim import build_optimizer
    from study.train.parallelize import parallelize
    from study.train.step import train_step

    recipe = spec.planned
    job = job_dist(spec.config, recipe.world_size)
    cfg = stepped_config(spec.config, job)
    here = Dist(0, job.world_size, 0, "cpu", job.nodes)
    sharded = job.world_size > 1
    micro, seq_len, vocab = recipe.micro_batch, cfg.data.seq_len, spec.model.vocab_size
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    with _phase("sharded"), fake_world(job.world_size):
        with _phase("built"):
            model = build_model(spec.model, "meta")
        # the mesh and the sharding are made on the meta device: a device mesh cannot be made under fake tensors
        model = parallelize(model, cfg, here)
        with FakeTensorMode(allow_non_fake_inputs=True):  # the meta parameters become fake ones
            model.to_empty(device="cpu")
            model.tie_weights()
            optimizer = build_optimizer(model, cfg.train, recipe.lr)
            x = torch.randint(0, vocab, (micro, seq_len))
            y = torch.randint(0, vocab, (micro, seq_len))
            batches = [(x, y)] * min(2, recipe.grad_accum)

            def step(micro_batches) -> None:
                train_step(model, model, optimizer, None, micro_batches, "cpu", cfg.train.z_loss,
                           cfg.train.grad_clip, autocast_bf16=False, sharded=sharded)

            seconds["build"] = time.perf_counter() - start
            with _phase("stepped"):
                # the first step makes the optimizer's state and fills DTensor's sharding cache: uncached, its
                # propagation runs on global shapes under this fake mode, which the tracker would count as memory
                step(batches[:1])
                if sharded:
                    tracker = peak_only(FSDPMemTracker)(model, optimizer)
                    tracker.track_inputs((x, y))
                else:
                    tracker = peak_only(MemTracker)()
                    tracker.track_external(model, optimizer, x, y)
                with tracker:
                    step(_Fresh(batches, tracker))
                peak = _by_name(tracker.get_tracker_snapshot("peak")[torch.device("cpu")])
                kept = _by_name(tracker.get_tracker_snapshot("current")[torch.device("cpu")])
            seconds["step"] = time.perf_counter() - start - seconds["build"]
    mark = time.perf_counter()
    with _phase("counted"):
        flops = model_flops(spec.model, seq_len, micro)
    seconds["flops"] = time.perf_counter() - mark
    breaks, reasons = None, []
    if trace:
        mark = time.perf_counter()
        with _phase("traced"):
            breaks, reasons = graph_breaks(spec, cfg)
        seconds["trace"] = time.perf_counter() - mark
    return Measured(
        layout=layout_name(cfg, job), micro_batches=len(batches), peak_gib=peak["Total"] / GIB,
        at_peak={k: v / GIB for k, v in peak.items() if k != "Total" and v},
        params_gib=(kept.get("Sharded Param") or kept.get("Parameter", 0)) / GIB,
        optimizer_gib=(kept.get("OptState") or kept.get("Optstate", 0)) / GIB,
        flops_per_token=flops,
        graph_breaks=breaks, break_reasons=reasons, seconds={k: round(v, 2) for k, v in seconds.items()})


def model_flops(model_cfg: ModelConfig, seq_len: int, micro_batch: int) -> float:
    """Training FLOPs per token torch counts in one forward and backward of the model on the meta device, for a micro
    batch of `micro_batch` x `seq_len` tokens. The model is the plain one: no sharding (each rank computes
    every matrix product of its micro batch whole) and no recomputation (checkpointed blocks compute their forward
    twice, which is hardware's work, not the model's)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from study.models.transformer import build_model
    from study.train.step import cross_entropy

    model = build_model(model_cfg, "meta")
    idx = torch.zeros((micro_batch, seq_len), dtype=torch.long, device="meta")
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        cross_entropy(model(idx), idx, z_loss=0.0).backward()  # a z-loss adds no matrix product
    return counter.get_total_flops() / (micro_batch * seq_len)


def graph_breaks(spec: RunSpec, cfg: RunConfig) -> tuple[int, list[str]]:
    """(graph breaks, their reasons) of torch.compile's trace of what a run compiles (study.train.parallelize.
    compile_blocks): each distinct block of the model (its parameters' names and shapes) once, on the meta device,
    with one micro batch of the run's length. Training compiles each block whole, so a break named here is a job that
    would fail at its first step."""
    import torch

    from study.models.transformer import build_model
    from study.train.parallelize import blocks

    model = build_model(spec.model, "meta")
    x = torch.zeros((spec.planned.micro_batch, cfg.data.seq_len, spec.model.d_model), device="meta")
    seen: set[tuple] = set()
    breaks, reasons = 0, []
    try:
        for block in blocks(model):
            shape = tuple((name, tuple(p.shape)) for name, p in block.named_parameters())
            if shape in seen:
                continue
            seen.add(shape)
            torch._dynamo.reset()
            explained = torch._dynamo.explain(block)(x, model.rope_cos, model.rope_sin)
            breaks += explained.graph_break_count
            reasons += [" ".join(str(b.reason).split()) for b in explained.break_reasons]
    finally:
        torch._dynamo.reset()
    return breaks, reasons
