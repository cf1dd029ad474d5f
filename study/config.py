"""The run configuration: typed sections, composed from the `sweeps/` tree, validated, and hashed into a run key.

Composition follows Hydra's defaults list in `sweeps/train.yaml` (scale, then the variant's model preset, then train,
data, cluster), then the experiment's shared overrides, then the variant's own, then command-line overrides. Plain
OmegaConf merges keep `study plan` fast for hundreds of runs; `python -m study.train -m` uses Hydra itself on the same
tree. A key that the typed config does not have is an error, never ignored.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from study.budget import BudgetConfig
from study.data.config import DataConfig
from study.errors import StudyError
from study.geometry.allocate import AllocationConfig
from study.models.config import ModelConfig
from study.tracking import TrackingConfig

GROUPS = ("scale", "model", "train", "data", "cluster")
# Fields that say where and how a run executes, not what it computes: they never change its run key.
LAUNCH_ONLY = ("cluster", "tracking", "eval", "paths", "faults")


@dataclass
class TrainConfig:
    micro_batch: int = 8
    """Sequences per rank per forward/backward."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step; global batch = micro_batch * grad_accum * world size."""
    global_batch: int = 0
    """When > 0, fixes the global batch in sequences and derives grad_accum from the world size (paired runs then see
    the same batches whatever their resources)."""
    max_steps: int = 0
    """Optimizer steps; 0 derives them from tokens_per_param."""
    tokens_per_param: float = 20.0
    """Training tokens per counted parameter when max_steps is 0 (Chinchilla, Hoffmann et al. 2022: about 20)."""
    lr: float = 0.0
    """Peak learning rate; 0 applies the OLMo model-ladder rule lr = 0.0047 * (N / 108e6) ** (-1/3)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    warmup_steps: int = 0
    """Linear warm-up steps; 0 means 2 % of max_steps (at least 1)."""
    schedule: str = "cosine"
    """`cosine` decay after warm-up, or `wsd` (warm-up, stable, linear decay over the last decay_fraction)."""
    decay_fraction: float = 0.2
    """WSD: share of steps spent decaying."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices only (never on norms or embeddings)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables it."""
    z_loss: float = 0.0
    """z-loss coefficient (OLMo-2: 1e-5): adds coef * mean(logsumexp(logits)^2)."""
    eval_interval: int = 50
    """Steps between validation passes (and always at the last step)."""
    eval_batches: int = 4
    """Validation batches per pass (fixed windows: every pass sees the same tokens)."""
    ckpt_interval: int = 50
    """Steps between checkpoints (and always at the last step)."""
    keep_last: int = 2
    """Complete checkpoints kept per run."""
    log_interval: int = 1
    """Steps between logged training metrics."""
    device: str = "auto"
    """`auto` (CUDA when present), `cpu` or `cuda`."""
    precision: str = "auto"
    """`auto` (bf16 mixed precision on CUDA, fp32 on CPU), `fp32` or `bf16`."""
    compile: bool = False
    """torch.compile the model (a GPU switch: no speed-up on CPU)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass (GPU memory switch)."""
    gpu_peak_tflops: float = 989.0
    """Peak dense bf16 TFLOP/s per GPU for MFU and GPU-hour estimates (H100 SXM datasheet)."""
    assumed_mfu: float = 0.4
    """MFU assumed by `study plan` when estimating GPU-hours."""


@dataclass
class EvalConfig:
    tasks: list[str] = field(default_factory=lambda: ["arc_easy", "hellaswag", "piqa"])
    """lm-eval task names; the shipped offline tasks are arc_easy_local, hellaswag_local, piqa_local."""
    after_train: bool = False
    """Evaluate the final checkpoint at the end of training."""
    limit: int = 0
    """Examples per task; 0 means all."""
    batch_size: int = 16
    """Requests per forward pass."""


@dataclass
class ClusterConfig:
    name: str = "local"
    """Profile name; `local` runs jobs without SLURM (submitit's local executor)."""
    partition: str = ""
    """SLURM partition."""
    account: str = ""
    """SLURM account."""
    qos: str = ""
    """SLURM quality of service."""
    constraint: str = ""
    """SLURM node constraint."""
    nodes: int = 1
    """Nodes per run."""
    gpus_per_node: int = 0
    """GPUs per node; each GPU is one task (rank). 0 means CPU ranks."""
    tasks_per_node: int = 1
    """Ranks per node when gpus_per_node is 0 (CPU FSDP over gloo)."""
    cpus_per_task: int = 1
    """CPUs per rank."""
    mem_gb: int = 0
    """Memory per node in GB; 0 leaves it to the cluster's default."""
    time_min: int = 60
    """Wall-clock limit per job in minutes."""
    signal_delay_s: int = 120
    """Seconds before the time limit at which SLURM sends USR2 (checkpoint, then requeue)."""
    max_requeues: int = 5
    """Requeues allowed per run after preemption or timeout."""
    array_parallelism: int = 16
    """Array tasks running at once."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before each job (module loads, environment activation)."""


@dataclass
class PathsConfig:
    runs: str = "runs"
    """Root of run directories (<runs>/<experiment>/<run_key>): checkpoints, logs, profiles."""
    profile: str = ""
    """Geometry profile a scheduled run takes its widths from (set by the planner from the reference run)."""


@dataclass
class FaultsConfig:
    nan_at_step: int = -1
    """Fault injection for tests: make the loss NaN at this step (-1 never)."""
    stop_at_step: int = -1
    """Fault injection for tests: behave as if SIGUSR2 arrived at this step (-1 never)."""
    sleep_per_step: float = 0.0
    """Fault injection for tests: sleep this long after every step, so signals land mid-run."""


@dataclass
class RunConfig:
    experiment: str = "adhoc"
    """Experiment name (the MLflow experiment)."""
    variant: str = "conventional"
    """Variant name within the experiment."""
    baseline: str = "conventional"
    """Variant this run is paired against in the report."""
    stage: str = "train"
    """`train`, `reference` (trains the model a geometry profile is measured on) or `scheduled` (widths from it)."""
    scale: str = "tiny"
    """Scale preset name."""
    seed: int = 0
    """Initialisation and data-order seed; runs sharing scale and seed are paired."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture."""
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    """Parameter budget and how this variant meets it."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus, tokenizer and sequence length."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation."""
    geometry: AllocationConfig = field(default_factory=AllocationConfig)
    """Geometry-scheduled widths (stage `scheduled`)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Downstream evaluation."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """MLflow."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Where jobs run."""
    paths: PathsConfig = field(default_factory=PathsConfig)
    """Where run directories live."""
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    """Fault injection (tests only)."""


def sweeps_dir() -> Path:
    """The config tree: $STUDY_SWEEPS, else the `sweeps/` folder of this checkout."""
    return Path(os.environ.get("STUDY_SWEEPS") or Path(__file__).resolve().parent.parent / "sweeps")


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (sweeps_dir() / group).glob("*.yaml"))


@functools.lru_cache(maxsize=None)
def load_yaml(path: Path) -> Any:
    from omegaconf import OmegaConf

    try:
        return OmegaConf.load(path)
    except Exception as exc:  # a YAML syntax error is the user's, not a bug
        raise StudyError(str(path), f"cannot be read as YAML ({exc})", "fix the file's syntax") from None


def group_file(group: str, option: str) -> Path:
    path = sweeps_dir() / group / f"{option}.yaml"
    if not path.is_file():
        raise StudyError(group, f"unknown option {option!r}", f"use one of {', '.join(group_options(group))}")
    return path


def split_overrides(overrides: list[str]) -> tuple[dict[str, str], list[str]]:
    """Separate group selections (`scale=113M`) from value overrides (`train.lr=3e-4`)."""
    groups, values = {}, []
    for item in overrides:
        if "=" not in item or item.startswith(("+", "~")) or item.split("=", 1)[0].strip() == "":
            raise StudyError(item, "is not a `key=value` override",
                             "write overrides as key=value, e.g. train.lr=3e-4 or scale=113M")
        key, value = item.split("=", 1)
        if key in GROUPS:
            groups[key] = value
        else:
            values.append(item)
    return groups, values


def merge_checked(base: Any, node: Any, where: str):
    """Merge `node` onto the typed config; an unknown key or a wrong type names the field."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.merge(base, node)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or where
        raise StudyError(str(key), f"is not valid in {where} ({str(exc).splitlines()[0]})",
                         "check the spelling and type against the typed config in study/config.py") from None


@functools.lru_cache(maxsize=None)
def typed_defaults():
    from omegaconf import OmegaConf

    return OmegaConf.structured(RunConfig)


def compose(groups: dict[str, str] | None = None, layers: list[Any] | None = None,
            overrides: list[str] | None = None) -> RunConfig:
    """Defaults (sweeps/train.yaml) <- selected group files <- `layers` (dicts) <- `key=value` overrides."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cli_groups, values = split_overrides(overrides or [])
    primary = load_yaml(sweeps_dir() / "train.yaml")
    chosen = {k: v for d in primary.get("defaults", []) if not isinstance(d, str) for k, v in d.items()}
    chosen.update(groups or {})
    chosen.update(cli_groups)
    nodes = [(OmegaConf.create({k: v for k, v in primary.items() if k != "defaults"}), "train.yaml")]
    nodes += [(load_yaml(group_file(g, chosen[g])), f"{g}/{chosen[g]}.yaml") for g in GROUPS if g in chosen]
    nodes += [(OmegaConf.create(layer), "the experiment file") for layer in layers or []]
    try:
        nodes.append((OmegaConf.from_dotlist(values), "the command-line overrides"))
    except OmegaConfBaseException as exc:
        raise StudyError(" ".join(values), f"cannot be parsed ({exc})", "write overrides as key=value") from None
    # One typed merge of the plain-merged layers is fast; per-layer merges only run to name the culprit.
    plain = [OmegaConf.to_container(node, resolve=False) for node, _ in nodes]
    try:
        merged = OmegaConf.merge(typed_defaults(), *plain)
    except OmegaConfBaseException:
        merged = typed_defaults()
        for node, where in nodes:
            merged = merge_checked(merged, node, where)
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise StudyError(str(getattr(exc, "full_key", "config")), f"cannot be resolved ({exc})",
                         "fix the value or the interpolation") from None


def to_dict(cfg: RunConfig) -> dict:
    from dataclasses import asdict

    return asdict(cfg)


def run_key(cfg: RunConfig) -> str:
    """Short stable hash of what the run computes (launcher-only sections excluded)."""
    payload = {k: v for k, v in to_dict(cfg).items() if k not in LAUNCH_ONLY}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def run_name(cfg: RunConfig) -> str:
    return f"{cfg.variant}-{cfg.scale}-s{cfg.seed}"
