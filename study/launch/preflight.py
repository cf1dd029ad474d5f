"""`study preflight EXPERIMENT`: every distinct shape of the plan stepped once at its real size on fake tensors, over a
fake process group of its job's real world size (study.train.preflight), before anything is submitted: the tracked
peak memory per rank, torch's FLOPs per token against the plan's, and the graph breaks of torch.compile's trace.

A shape is what the measurement depends on (`shape_of`): the matched model, the sequence length, the job's layout
(ranks, nodes, sharding, micro batch, whether it accumulates, precision, activation checkpointing), torch's version
and the code that builds, lays out and steps the model. Runs that share one (seeds, tune points, LRs) are measured
once, and each result is kept in the cache (`<cache>/preflight/<shape>.json`), so asking again costs a third of a
second.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from study.config.spec import RunSpec
from study.errors import StudyError

VERSION = 2
"""What a cached result holds and how it was measured; raised when either changes, so older results are measured
again instead of read."""


@dataclass
class Shape:
    """One distinct shape of the plan and what its fake step showed."""

    digest: str
    """The shape's digest: its cache entry's name."""
    runs: list[RunSpec]
    """The runs of the plan that share it."""
    measured: dict = field(default_factory=dict)
    """study.train.preflight.Measured as a dict (GiB, FLOPs, graph breaks, seconds)."""
    cached: bool = False
    """Read from the cache instead of measured now."""

    @property
    def spec(self) -> RunSpec:
        return self.runs[0]

    @property
    def plan_flops_per_token(self) -> float:
        return float(self.spec.flops_per_token)

    def as_json(self) -> dict:
        m = self.spec.model
        return {"shape": self.digest, "runs": [r.key for r in self.runs], "names": [r.name for r in self.runs],
                "d_model": m.d_model, "n_layers": m.n_layers, "seq_len": self.spec.config.data.seq_len,
                "micro_batch": self.spec.planned.micro_batch, "world_size": self.spec.planned.world_size,
                **self.measured, "plan_flops_per_token": self.plan_flops_per_token,
                **dict(zip(("estimated_peak_here_gib", "estimated_peak_gib"), estimated_peaks(self.spec))),
                "cached": self.cached}


def shape_of(spec: RunSpec) -> dict:
    """What one fake step of `spec` depends on: two runs that agree here step alike."""
    from importlib.metadata import version

    from study.train.parallelize import sharding
    from study.train.preflight import job_dist, stepped_config

    r, cfg = spec.planned, spec.config
    job = job_dist(cfg, r.world_size)
    stepped = stepped_config(cfg, job)
    return {"version": VERSION, "torch": version("torch"), "code": _code(), "model": asdict(spec.model),
            "seq_len": cfg.data.seq_len, "world_size": job.world_size, "nodes": job.nodes,
            "sharding": sharding(stepped, job), "micro_batch": r.micro_batch, "accumulates": r.grad_accum > 1,
            "precision": stepped.train.precision, "activation_checkpointing": cfg.train.activation_checkpointing,
            "z_loss": bool(cfg.train.z_loss)}


@functools.cache
def _code() -> str:
    """A digest of the code a measurement runs (study.train.preflight.CODE): the model, its layout, the step."""
    import study
    from study.data.cache import file_digest
    from study.train.preflight import CODE

    return file_digest([Path(study.__file__).parent / name for name in CODE])


def distinct_shapes(runs: list[RunSpec]) -> tuple[list[Shape], list[RunSpec]]:
    """(the distinct shapes of `runs`, in plan order; the runs whose widths are not known yet)."""
    from study.config.identity import json_digest

    shapes: dict[str, Shape] = {}
    pending = []
    for run in runs:
        if run.params is None:
            pending.append(run)
            continue
        digest = json_digest(shape_of(run))
        shapes.setdefault(digest, Shape(digest, [])).runs.append(run)
    return list(shapes.values()), pending


def cache_file(shape: Shape) -> Path:
    """Where the shape's result is kept: beside the data cache its runs share (`data.cache_dir`, else $STUDY_CACHE
    or ~/.cache/study)."""
    from study.config.data import cache_root

    return cache_root(shape.spec.config.data) / "preflight" / f"{shape.digest}.json"


def _unkept(folder: Path, err: OSError) -> StudyError:
    return StudyError("data.cache_dir", f"preflight results cannot be kept in {folder} ({err.strerror or err})",
                      "point data.cache_dir (or STUDY_CACHE) at a folder you can write to")


def _cached(path: Path, trace: bool) -> dict | None:
    """The result kept at `path`, if it is one this call can use (traced when a trace is asked for)."""
    try:
        found = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:  # a damaged entry is measured again and rewritten
        print(f"study preflight: {path} is unreadable ({err}); measuring the shape again", file=sys.stderr)
        return None
    measured = found.get("measured") if isinstance(found, dict) and found.get("version") == VERSION else None
    if not isinstance(measured, dict) or (trace and measured.get("graph_breaks") is None):
        return None
    return measured


def preflight(runs: list[RunSpec], trace: bool = True, again: bool = False,
              echo: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> tuple[list[Shape], list[RunSpec]]:
    """Measure every distinct shape of `runs` not measured yet (all of them with `again`); (shapes, pending runs).
    A shape that cannot be built, sharded or stepped stops the command, naming its runs and torch's error."""
    from study.files import replace_file
    from study.train.preflight import StepFailed, measure

    shapes, pending = distinct_shapes(runs)
    todo = []
    for shape in shapes:
        found = None if again else _cached(cache_file(shape), trace)
        if found is None:
            todo.append(shape)
        else:
            shape.measured, shape.cached = found, True
    for folder in {cache_file(shape).parent for shape in todo}:  # before anything is measured
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise _unkept(folder, err) from None
    for shape in todo:
        path = cache_file(shape)
        names = ", ".join(r.name for r in shape.runs[:3]) + (f" and {len(shape.runs) - 3} more"
                                                              if len(shape.runs) > 3 else "")
        ranks = shape.spec.planned.world_size
        echo(f"preflight: shape {shape.digest} ({names}): {ranks} fake rank{'s' * (ranks > 1)}")
        try:
            shape.measured = asdict(measure(shape.spec, trace=trace))
        except StepFailed as failed:
            raise StudyError("preflight", f"run {shape.spec.name} ({shape.spec.key}) cannot be {failed.phase} at "
                             f"its planned layout ({shape.spec.planned.world_size} ranks on "
                             f"{shape.spec.config.cluster.nodes} node(s), micro batch "
                             f"{shape.spec.planned.micro_batch}): {failed.error}",
                             "fix the run's model or layout (model.*, cluster.nodes, train.sharding, "
                             "train.micro_batch), then run `study preflight` again") from failed.__cause__
        try:
            replace_file(path, json.dumps({"version": VERSION, "shape": shape_of(shape.spec),
                                           "measured": shape.measured}, indent=1))
        except OSError as err:
            raise _unkept(path.parent, err) from None
    return shapes, pending


def estimated_peaks(spec: RunSpec) -> tuple[float, float]:
    """The plan's analytic peak per rank (study.plan.memory), in GiB: (of the step measured here, on the CPU's
    kernels in the precision the fake step computes in; of the run on its devices at its planned layout). On a GPU
    profile they differ by what CUDA's kernels keep otherwise (RMSNorm's fused kernel keeps no fp32 copies)."""
    from study.plan.memory import GIB, planned_layout, run_memory
    from study.train.preflight import job_dist, stepped_config

    r = spec.planned
    stepped = stepped_config(spec.config, job_dist(spec.config, r.world_size))
    here = planned_layout(stepped, r.micro_batch, r.grad_accum, cuda=False)
    return run_memory(spec, here).peak / GIB, run_memory(spec).peak / GIB


def print_preflight(experiment: str, shapes: list[Shape], pending: list[RunSpec]) -> None:
    from study.console import plain_table, text_width, wrapped

    width = text_width()
    cols = ["shape", "runs", "layout", "micro", "peak GiB", "est. here", "est. device", "params GiB", "optim GiB",
            "GFLOP/tok torch", "plan", "graph breaks", "s"]
    rows = []
    for shape in shapes:
        m, spec = shape.measured, shape.spec
        here, device = estimated_peaks(spec)
        breaks = m["graph_breaks"]
        rows.append([
            shape.digest, f"{spec.config.variant}-{spec.config.scale}" + (f" +{len(shape.runs) - 1}"
                                                                           if len(shape.runs) > 1 else ""),
            m["layout"], f"{spec.planned.micro_batch}x{m['micro_batches']}", f"{m['peak_gib']:.3g}",
            f"{here:.3g}", f"{device:.3g}", f"{m['params_gib']:.3g}", f"{m['optimizer_gib']:.3g}",
            f"{m['flops_per_token'] / 1e9:.4g}", f"{shape.plan_flops_per_token / 1e9:.4g}",
            "not traced" if breaks is None else str(breaks),
            "cached" if shape.cached else f"{sum(m['seconds'].values()):.1f}"])
    print(plain_table(f"{experiment}: {len(shapes)} distinct shapes, one fake step each (per rank, rank 0)", cols,
                      rows, left={"runs", "layout"}, width=width, keep=3), flush=True)
    if shapes:
        print(wrapped("peak: tracked on fake tensors, the CPU's kernels; est. here: study.plan.memory's estimate of "
                      "that step; est. device: its estimate on the run's devices, what `study launch` checks", width))
    for shape in shapes:
        m = shape.measured
        if m["flops_per_token"] != shape.plan_flops_per_token:
            print(wrapped(f"shape {shape.digest}: torch counts {m['flops_per_token']:,.0f} FLOPs per token, the plan "
                          f"{shape.plan_flops_per_token:,.0f} (study.plan.budget.flops_per_token)", width))
        for reason in m["break_reasons"]:
            print(wrapped(f"shape {shape.digest}: graph break: {reason}", width))
    if pending:
        print(wrapped(f"{len(pending)} runs not measured: their widths wait for the {pending[0].pending}", width))
