"""From a run key or a checkpoint folder to the trained model and its tokenizer, for `study eval` and lm-eval's CLI."""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from study.config.spec import RunSpec, read_spec
from study.errors import StudyError
from study.schema import TAG_RUN_KEY
from study.train import checkpoint
from study.train.state import TrainState

_KEY_FIX = "take the key from `study plan EXPERIMENT` or `study status EXPERIMENT`"


@dataclass(frozen=True)
class TrainedRun:
    """A run's checkpoint opened for scoring."""

    spec: RunSpec
    """The run spec the model was built from."""
    checkpoint: Path
    """The complete checkpoint whose weights the model holds."""
    model: Any
    """The Transformer in eval mode (torch.nn.Module)."""
    tokenizer_path: Path
    """The tokenizer.json the run was trained with."""

    @property
    def step(self) -> int:
        return int(self.checkpoint.name.split("_")[-1])


def find_run(key: str, runs_root: str | Path = "runs", tracking_uri: str | None = None) -> RunSpec:
    """The spec of the run with this key: `<runs_root>/<experiment>/<key>/run.json`, else (given a tracking URI) the
    run directory its MLflow run recorded."""
    if not re.fullmatch(r"[0-9a-f]{12}", key):
        raise StudyError("RUN_KEY", f"{key!r} is not a run key (12 hexadecimal characters)", _KEY_FIX)
    found = sorted(Path(runs_root).glob(f"*/{key}/run.json"))
    if found:
        spec = read_spec(found[0])
    elif tracking_uri:
        spec = read_spec(_run_dir_from_mlflow(key, tracking_uri))
    else:
        raise StudyError("RUN_KEY", f"no run with key {key!r} under {Path(runs_root).resolve()}",
                         f"{_KEY_FIX} (launch it first), or name the runs folder (paths.runs=DIR; lm-eval: runs=DIR) "
                         "or the MLflow store that tracks it (lm-eval: tracking_uri=URI)")
    if spec.key != key:
        raise StudyError("RUN_KEY", f"{spec.run_dir.spec} holds the spec of run {spec.key}, not {key}",
                         "a run directory holds its own run.json only: relaunch the experiment to rewrite it")
    return spec


def _run_dir_from_mlflow(key: str, tracking_uri: str) -> Path:
    """The run directory the run's `run.json` artifact names (the spec training logged)."""
    from study.track.query import open_store, readable

    client = open_store(tracking_uri)
    if client is None:
        raise StudyError("tracking_uri", f"no MLflow store at {tracking_uri}", "name the store the run was tracked in")
    with readable(tracking_uri):
        ids = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(ids, filter_string=f"tags.`{TAG_RUN_KEY}` = '{key}'", max_results=10) if ids else []
        if not runs:
            raise StudyError("RUN_KEY", f"no MLflow run with key {key!r} in {tracking_uri}", _KEY_FIX)
        with tempfile.TemporaryDirectory() as tmp:
            spec = json.loads(Path(client.download_artifacts(runs[0].info.run_id, "run.json", tmp)).read_text())
    run_dir = Path(spec["dir"])
    if not run_dir.is_dir():
        raise StudyError("RUN_KEY", f"run {key}'s directory {run_dir} (recorded in MLflow) is not on this machine",
                         "evaluate where the run directories are, or pass runs=<folder holding them>")
    return run_dir


def run_of_checkpoint(path: str | Path) -> tuple[RunSpec, Path]:
    """The run a checkpoint folder (`<run dir>/checkpoints/step_N`) belongs to, checked against its train state."""
    path = Path(path).resolve()
    if not checkpoint.is_complete(path):
        raise StudyError("checkpoint", f"{path} is not a complete checkpoint",
                         "name a <run dir>/checkpoints/step_<N> folder that has its .metadata and train_state.json")
    spec = read_spec(path.parent.parent)
    state = TrainState.read(path / "train_state.json")
    if state.run_key and state.run_key != spec.key:
        raise StudyError("checkpoint", f"{path} belongs to run {state.run_key}, not to {spec.key} whose "
                         "directory holds it", "name a checkpoint inside its own run's directory")
    return spec, path


def load_trained_model(spec: RunSpec, device: str = "cpu", ckpt: Path | None = None):
    """The run's model (built from its spec) with the weights of `ckpt`, by default its latest complete checkpoint,
    in eval mode; returns (model, checkpoint)."""
    from study.models.transformer import build_model

    if spec.pending is not None:
        raise StudyError("RUN_KEY", f"run {spec.key}'s spec is still pending ({spec.pending})",
                         "let its job complete the spec and train it first")
    with checkpoint.reading(spec.run_dir.path):  # a trainer still saving keeps the checkpoint while it is read
        ckpt = ckpt or checkpoint.latest(spec.run_dir.path)
        if ckpt is None or not checkpoint.is_complete(ckpt):
            raise StudyError("RUN_KEY", f"run {spec.key} has no complete checkpoint "
                             f"{'yet' if ckpt is None else ckpt.name + ' any more (pruned by its training)'}",
                             "train it first (study train/launch), or name a checkpoint it keeps")
        model = build_model(spec.model, device, seed=spec.config.weights_seed)
        checkpoint.load_model_weights(ckpt, model)
    return model.eval(), ckpt


def open_trained(spec: RunSpec, ckpt: Path | None = None, device: str = "cpu") -> TrainedRun:
    """The run's model at `ckpt` (default: its latest checkpoint) and the tokenizer it was trained with."""
    model, ckpt = load_trained_model(spec, device, ckpt)
    return TrainedRun(spec, ckpt, model, run_tokenizer(spec))


def run_eos_token(spec: RunSpec, tokenizer_path: Path) -> str | None:
    """The end-of-document token the run trained with: the one recorded beside its tokenizer, else `data.eos_token`
    (None: the first of EOS_CANDIDATES, as for runs that predate the record)."""
    from study.data.tokenizer import declared_eos

    return declared_eos(tokenizer_path.parent) or spec.config.data.eos_token


def run_tokenizer(spec: RunSpec) -> Path:
    """The tokenizer the run was trained with: its run directory's copy, else (older runs) the one beside its shards
    in the cache; never tokenises anything."""
    if spec.run_dir.tokenizer.is_file():
        return spec.run_dir.tokenizer
    from study.data.shards import find_shards

    entry = find_shards(spec.config.data)
    if entry is None:
        raise StudyError("RUN_KEY", f"run {spec.key} has no tokenizer.json in {spec.run_dir.path} and its token "
                         "shards are not in the data cache", "point data.cache_dir (or $STUDY_CACHE) at the cache "
                         "it was trained from, or copy its tokenizer.json into the run directory")
    return entry / "tokenizer.json"
