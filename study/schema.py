"""Names other tools rely on, in one place: MLflow tags and metric names (DESIGN.md's schema) and the layout of a
run directory and of an experiment's launch folder."""

from __future__ import annotations

from pathlib import Path

# MLflow tags (users filter the UI by these; analysis reads them)
TAG_RUN_KEY = "study.run_key"
TAG_EXPERIMENT = "study.experiment"
TAG_VARIANT = "study.variant"
TAG_SCALE = "study.scale"
TAG_SEED = "study.seed"
TAG_STAGE = "study.stage"
TAG_BASELINE = "study.baseline"
TAG_SLURM_JOB = "study.slurm_job_id"
TAG_SLURM_RESTARTS = "study.slurm_restart_count"
TAG_RESTARTS = "study.restarts"
TAG_KEY_SCHEMA = "study.key_schema"
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


class RunDir:
    """<runs>/<experiment>/<run key>/: everything one run leaves on disk."""

    def __init__(self, path: Path | str):
        self.path = Path(path)

    @classmethod
    def of(cls, runs_root: str | Path, experiment: str, key: str) -> RunDir:
        return cls(Path(runs_root).resolve() / experiment / key)

    spec = property(lambda self: self.path / "run.json")
    """The run spec: what to build and train (written by the launcher, completed by a scheduled run's job)."""
    config = property(lambda self: self.path / "config.yaml")
    """The resolved config, for people (also an MLflow artifact)."""
    checkpoints = property(lambda self: self.path / "checkpoints")
    metrics = property(lambda self: self.path / "metrics.jsonl")
    """Every metric point the run logged, appended before it is sent (the store is made to match it)."""
    progress = property(lambda self: self.path / "progress.json")
    """The trainer's latest figures (step, max_steps, loss, tokens/s, ETA), replaced at every logged step."""
    lease = property(lambda self: self.path / ".lease")
    """Held (flock) by the one process training the run."""
    evals = property(lambda self: self.path / EVALS)
    """One folder per evaluation, `<evaluation id>/` with EVAL_RECORD, EVAL_RESULTS and ITEMS_ARTIFACT."""
    result = property(lambda self: self.path / "result.json")
    """Written when training finished: final step and validation loss."""
    tokenizer = property(lambda self: self.path / "tokenizer.json")
    """A copy of the tokenizer the run was trained with: evaluation and profiling read it, never the data."""
    profile = property(lambda self: self.path / "profile.json")
    """A reference run's geometry profile (and profile.png, widths.png beside it)."""
    export = property(lambda self: self.path / "export")
    """`study export`'s default output: the latest checkpoint as transformers (or study-format) files."""


def launch_dir(runs_root: str | Path, experiment: str) -> Path:
    """<runs>/<experiment>/_launch/: the job journal (jobs.jsonl) and the launch manifest (manifest.jsonl)."""
    return Path(runs_root).resolve() / experiment / "_launch"


def submitit_dir(runs_root: str | Path, experiment: str) -> Path:
    return Path(runs_root).resolve() / experiment / "_submitit"
