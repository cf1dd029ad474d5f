"""The whole configuration of one run: which experiment and variant it belongs to, and every section."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from enum import StrEnum

from study.config.budget import BudgetConfig
from study.config.cluster import ClusterConfig, PathsConfig
from study.config.data import DataConfig
from study.config.faults import FaultsConfig
from study.config.geometry import AllocationConfig
from study.config.model import ModelConfig
from study.config.tracking import TrackingConfig
from study.config.training import TrainConfig


@dataclass
class EvalConfig:
    """Downstream (lm-eval) evaluation settings (none of them changes a run's key)."""

    tasks: list[str] = field(default_factory=lambda: ["arc_easy", "hellaswag", "piqa"])
    """lm-eval task names; the shipped offline tasks are arc_easy_local, hellaswag_local, piqa_local, sciq_local."""
    after_train: bool = False
    """Evaluate the final checkpoint at the end of training."""
    limit: int = field(default=0, metadata={"non_negative": True})
    """Examples per task; 0 means all."""
    num_fewshot: int = field(default=0, metadata={"non_negative": True})
    """Solved examples put before each prompt (lm-eval's num_fewshot)."""
    batch_size: int = field(default=16, metadata={"positive": True})
    """Requests per forward pass."""


class Role(StrEnum):
    """A run's role in the pipeline (`RunConfig.role`; MLflow tag `study.role`); it never changes the run key. Members
    are named as their values: OmegaConf reads a config's string into the member of that name."""

    train = "train"
    """An ordinary trained run of a comparison (paired by seed with its baseline)."""
    reference = "reference"
    """A trained run whose geometry work profile scheduled runs take their widths from (also paired as a train run)."""
    scheduled = "scheduled"
    """A run whose FFN widths come from its reference's profile (pending until the profile exists)."""
    tune = "tune"
    """A point of an arm's tuning LR grid: never paired, decided on or fitted in the report."""
    calibrate = "calibrate"
    """A short throughput measurement of one shape (`study calibrate`): no seeds to group, never analysed."""
    trunk = "trunk"
    """The stable-LR stem of a branched run (`branches:`), trained to its last branch point; never paired or fitted."""
    branch = "branch"
    """A decay branch from its trunk's checkpoint at a branch point: a straight WSD run of its length, which the report
    pairs (the largest point) and fits (every point)."""


@dataclass
class RunConfig:
    experiment: str = "adhoc"
    """Experiment name (the MLflow experiment)."""
    variant: str = "conventional"
    """Variant name within the experiment."""
    baseline: str = "conventional"
    """Variant this run is paired against in the report."""
    role: Role = field(default=Role.train, metadata={"choices": tuple(Role)})
    """The run's role in the pipeline (`Role`), set by the planner; the old name `stage` is refused, naming this."""
    scale: str = "tiny"
    """Scale preset name."""
    seed: int = field(default=0, metadata={"non_negative": True})
    """The run's seed: runs sharing scale and seed are paired; it seeds initialisation and data order unless
    init_seed or data_seed set them apart."""
    init_seed: int | None = None
    """Seed of the weight initialisation; None means `seed` (apart from data_seed, the two sources of seed variance
    vary separately: Bouthillier et al. 2021)."""
    data_seed: int | None = None
    """Seed of the training data order; None means `seed`."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture."""
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    """Parameter budget and how this variant meets it."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus, tokenizer and sequence length."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation."""
    geometry: AllocationConfig = field(default_factory=AllocationConfig)
    """Geometry-scheduled widths (role `scheduled`)."""
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

    @property
    def weights_seed(self) -> int:
        """The seed the initial weights are drawn from."""
        return self.seed if self.init_seed is None else self.init_seed

    @property
    def order_seed(self) -> int:
        """The seed of the order the training windows are visited in."""
        return self.seed if self.data_seed is None else self.data_seed


def leaves(node, prefix: str = "", into_lists: bool = False) -> dict:
    """A config (a dataclass, or a nested dict such as its `asdict`) as {dotted key: leaf value}; lists are leaves
    unless `into_lists` (then their items are, keyed by index). A dataclass is read in place: no copy is made."""
    items = (node.items() if isinstance(node, dict)
             else ((f.name, getattr(node, f.name)) for f in fields(node)) if is_dataclass(node)
             else enumerate(node) if into_lists and isinstance(node, list) else None)
    if items is None:
        return {prefix[:-1]: node}
    return {dotted: leaf for k, v in items for dotted, leaf in leaves(v, f"{prefix}{k}.", into_lists).items()}


def run_name(cfg: RunConfig) -> str:
    """The MLflow run name (study.schema): `<variant>-<scale>-s<seed>`."""
    return f"{cfg.variant}-{cfg.scale}-s{cfg.seed}"
