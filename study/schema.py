"""Names other tools rely on, in one place: MLflow tags and metric names (the study's tracking schema) and the layout
of a run directory and of an experiment's launch folder."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping

from study.errors import StudyError

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
"""Names of experiments, variants, scales and config-group options, which become directory, MLflow and job names: one
word starting with a letter or digit (so never `.`, `..` or a path)."""


def check_name(field: str, value: str, what: str = "name") -> None:
    """Refuse `value`, naming `field`, unless it is one NAME (`experiment=../../x` would leave `paths.runs`)."""
    if not isinstance(value, str) or not NAME.match(value):
        raise StudyError(field, f"{str(value)[:120]!r} is not {what}",
                         "use letters, digits, _ . - (starting with a letter or digit, at most 100 characters)")


# MLflow tags (users filter the UI by these; analysis reads them)
TAG_RUN_KEY = "study.run_key"
TAG_EXPERIMENT = "study.experiment"
TAG_VARIANT = "study.variant"
TAG_SCALE = "study.scale"
TAG_SEED = "study.seed"
TAG_ROLE = "study.role"
"""What a run is in the study: a training run's `study.config.run.Role`, or for a run that trains nothing one of the
`ROLE_*` values below."""
OLD_TAG_ROLE = "study.stage"
"""The role in stores written before `study.role`: read only (`role_of`, `study.track.query.runs_with_role`)."""
ROLE_REPORT = "report"
"""Role of an experiment's report run (`study report`: the report's files)."""
ROLE_GROUP = "group"
"""Role of a parent run: one per (variant, scale), its seed runs nested under it (study.track.groups)."""
ROLE_SEQUENTIAL = "sequential"
"""Role of the experiment-level run that records every look of an adaptive launch (analysis.sequential)."""
ROLE_RACING = "racing"
"""Role of the experiment-level run that records a race's verdicts and stops (study.launch.racing)."""
NOT_TRAINING = (ROLE_REPORT, ROLE_GROUP, ROLE_SEQUENTIAL, ROLE_RACING)
"""Roles of runs that trained nothing: never read as training runs."""


def role_of(tags: Mapping[str, str]) -> str | None:
    """A run's role from its tags, in a store written before `study.role` from the tag it had then."""
    return tags.get(TAG_ROLE, tags.get(OLD_TAG_ROLE))


TAG_BASELINE = "study.baseline"
TAG_REPLACED = "study.replaced"
"""On a run set aside by `study.track.store.retire_runs`: when and why it was replaced by one trained from step 0."""
TAG_FAILURE_REASON = "study.failure_reason"
"""Why a run failed, in one line (set when its tracker closes FAILED)."""
TAG_SLURM_JOB = "study.slurm_job_id"
TAG_SLURM_RESTARTS = "study.slurm_restart_count"
TAG_RESTARTS = "study.restarts"
TAG_KEY_SCHEMA = "study.key_schema"
TAG_WORLD_SIZE = "study.world_size"
"""Ranks the run's latest start trained on (a resume may use another world size: the same global batch)."""
TAG_HOSTS = "study.hosts"
"""Every host the run's ranks ran on, comma-separated, in the order they first trained it (over all its starts)."""
TAG_LAYOUT = "study.layout"
"""Which layout trained which steps: one `from step S: N nodes x R ranks, <sharding>` per start, `; `-separated."""
TAG_LR_SOURCE = "study.lr_source"
"""`tune` when declared tuning chose the run's peak LR, `recipe` when the recipe's rule or train.lr did."""
TAG_TUNE_MULTIPLE = "study.tune.multiple"
"""The multiple of the recipe's peak LR a tune run trains at, or a tuned main run's chosen one."""
TAG_TUNE_STATUS = "study.tune.status"
"""A tuned main run's choice: `interior`, `extended` or `edge` (study.plan.tune)."""
TAG_TRUNK_KEY = "study.trunk_key"
"""A decay branch's trunk: the run key of the stable-LR run whose checkpoint it starts from."""
TAG_BRANCH_STEP = "study.branch.step"
"""The trunk's checkpoint step a decay branch starts from."""
TAG_BRANCH_AT = "study.branch.at"
"""A decay branch's point: its length as a fraction of the run's planned tokens (`branches.at`)."""
# MLflow experiment tags written by `study launch`: the latest launch's overrides and, in chunks, its run keys
TAG_LAUNCH = "study.launch"
TAG_LAUNCH_KEYS = "study.launch.keys"

# metric names
TRAIN_LOSS, TRAIN_LR, TRAIN_GRAD_NORM = "train/loss", "train/lr", "train/grad_norm"
TRAIN_TOKENS_PER_S, TRAIN_MFU, TRAIN_PREEMPTED_AT = "train/tokens_per_s", "train/mfu", "train/preempted_at"
VAL_LOSS, VAL_PPL = "val/loss", "val/ppl"
EVAL_PREFIX = "eval/"
# One evaluation of a run (`study eval`, or the evaluation after training) is one folder `evals/<evaluation id>/`,
# in the run directory and among the MLflow run's artifacts alike.
EVALS = "evals"
EVAL_RECORD = "record.json"
"""The evaluation's settings (tasks, limit, few-shot, checkpoint step), item counts, chance levels and scores."""
EVAL_RESULTS = "eval.json"
"""lm-eval's full results of the evaluation."""
ITEMS_ARTIFACT = "items.jsonl"
"""One JSON line per (task, document) with its per-item scores and number of choices."""
TAG_EVAL = "study.eval."
"""Tag prefix: `study.eval.<task>` names the evaluation whose scores are the run's `eval/<task>/*` metrics."""


def eval_artifact(eval_id: str, name: str = "") -> str:
    """Where an evaluation's file `name` (or, without one, its folder) lies among the run's artifacts."""
    return f"{EVALS}/{eval_id}/{name}".rstrip("/")


def not_a_link(path: Path) -> Path:
    """`path`, refused when it is a symbolic link. The run's own files are written where they lie: a link planted in
    a run directory would have training truncate or overwrite a file outside it."""
    if path.is_symlink():
        raise StudyError(str(path), "is a symbolic link, and the run's files are never written through one",
                         f"remove the link (the run writes its own {path.name} in its directory)")
    return path


def _own(name: str) -> property:
    return property(lambda self: not_a_link(self.path / name))


class RunDir:
    """<runs>/<experiment>/<run key>/: everything one run leaves on disk, each file or folder refused when it is a
    symbolic link (`not_a_link`)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)

    def refuse_links(self) -> None:
        """Every file and folder of the layout below, checked at once (the trainer does so before it writes)."""
        for name, attr in vars(RunDir).items():
            if isinstance(attr, property):
                getattr(self, name)

    @classmethod
    def of(cls, runs_root: str | Path, experiment: str, key: str) -> RunDir:
        return cls(Path(runs_root).resolve() / experiment / key)

    spec = _own("run.json")
    """The run spec: what to build and train (written by the launcher, completed by a scheduled run's job)."""
    config = _own("config.yaml")
    """The resolved config, for people (also an MLflow artifact)."""
    checkpoints = _own("checkpoints")
    metrics = _own("metrics.jsonl")
    """Every metric point the run logged, appended before it is sent (the store is made to match it)."""
    progress = _own("progress.json")
    """The trainer's latest figures (step, max_steps, loss, tokens/s, ETA), replaced at every logged step."""
    lease = _own(".lease")
    """Held (flock) by the one process training the run."""
    evals = _own(EVALS)
    """One folder per evaluation, `<evaluation id>/` with EVAL_RECORD, EVAL_RESULTS and ITEMS_ARTIFACT."""
    result = _own("result.json")
    """Written when training finished: final step and validation loss."""
    tokenizer = _own("tokenizer.json")
    """A copy of the tokenizer the run was trained with: evaluation and profiling read it, never the data."""
    profile = _own("profile.json")
    """A reference run's geometry profile (and profile.png, widths.png beside it)."""
    export = _own("export")
    """`study export`'s default output: the latest checkpoint as transformers (or study-format) files."""


def launch_dir(runs_root: str | Path, experiment: str) -> Path:
    """<runs>/<experiment>/_launch/: the job journal (jobs.jsonl) and the launch manifest (manifest.jsonl), refused
    when it is a symbolic link."""
    return not_a_link(Path(runs_root).resolve() / experiment / "_launch")


def submitit_dir(runs_root: str | Path, experiment: str) -> Path:
    return Path(runs_root).resolve() / experiment / "_submitit"
