"""Read an experiment's training runs from MLflow into one pandas row per run: the finals from one paged
``search_runs`` (MLflow's latest value is the value at the largest step, the schema's "final"), the curves (one
history call per run) only where a figure or time to target needs them.
"""

from __future__ import annotations

import json
import math
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping

import numpy as np
import pandas as pd

from study import schema
from study.config.identity import SCHEMA_VERSION
from study.errors import StudyError
from study.config.run import Role
from study.plan.fairness import shared as is_shared
from study.schema import NOT_TRAINING, TAG_BRANCH_AT, TAG_BRANCH_STEP, TAG_KEY_SCHEMA, TAG_TRUNK_KEY, role_of
from study.track.query import all_runs, open_store, read, read_manifest_tags
from study.track.store import resolve_tracking_uri

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient


FINISHED = "FINISHED"
"""MLflow status of a run that ended normally; only these enter the statistics."""

_REQUIRED_TAGS = (schema.TAG_VARIANT, schema.TAG_SCALE, schema.TAG_SEED)
_SCALE_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def experiment_id(store: MlflowClient, experiment: str) -> str:
    """The id of the experiment named ``experiment``; a StudyError listing the names present otherwise."""
    found = store.get_experiment_by_name(experiment)
    if found is None:
        names = sorted(e.name for e in store.search_experiments())
        raise StudyError("experiment", f"no MLflow experiment named {experiment!r}",
                         f"choose one of: {', '.join(names) or '(the store has no experiments yet)'}")
    return found.experiment_id


TUNED, SHARED = "tune", "recipe"
"""Values of ``study.lr_source``: each variant at the LR its own tune runs found best, or the recipe's shared LR."""


@dataclass(frozen=True)
class StudyRuns:
    """An experiment's runs as the report reads them: the runs it decides on, kept apart from the rest."""

    runs: pd.DataFrame
    """Main runs decided on: the tuned ones when the store holds any, else the shared-LR ones (in a branched
    experiment, the decay branches at the largest point: the planned runs' ends)."""
    shared_lr: pd.DataFrame | None
    """Main runs at the shared LR beside tuned ones, for verdicts side by side; None unless the store holds both."""
    tune: pd.DataFrame
    """Tune runs (``study.role=tune``): points of an LR grid, never paired, decided on or fitted."""
    branches: pd.DataFrame = field(default_factory=pd.DataFrame)
    """Every decay branch at every point, of the LR source of :attr:`runs` (what :mod:`analysis.surface` fits). Trunks
    are in no frame: a trunk's last loss is not the end of a schedule."""
    notes: tuple[str, ...] = ()
    """Lines for the report to print: the runs it left out and why, the (variant, scale) cells with no run."""


def read_runs(experiment: str, tracking_uri: str | None = None) -> pd.DataFrame:
    """The training runs of ``experiment`` that pairing and decisions see (:attr:`StudyRuns.runs`)."""
    return read_study(experiment, tracking_uri).runs


def read_study(experiment: str, tracking_uri: str | None = None) -> StudyRuns:
    """Every training run of ``experiment`` (one row each, :func:`_row`, unfinished ones too) from one paged query,
    split into tune runs, main runs at a tuned LR and at the shared LR (:class:`StudyRuns`). With a launch manifest,
    each kind is the last launch's runs if it trained any of that kind, else all of it; a run key's run is its oldest;
    runs of another key schema are left out and named in the notes.
    """
    store = open_store(tracking_uri, required=True)
    exp_id = experiment_id(store, experiment)
    listed = read(lambda: list(all_runs(store, exp_id)), resolve_tracking_uri(tracking_uri or ""), "runs")
    rows = [row for row in map(_row, listed) if row is not None]
    current = (None, str(SCHEMA_VERSION))  # untagged: runs written by other tools (benchmarks.synthetic_store)
    other = [row for row in rows if row["key_schema"] not in current]
    left_out = (f"Left out {len(other)} run(s) of another key schema (this version's is {SCHEMA_VERSION}): "
                + ", ".join(f"{r['run_name']} (schema {r['key_schema']})" for r in other)
                + f"; relaunch the experiment (`study launch {experiment}`) to train them under the current keys."
                if other else "")
    rows = [row for row in rows if row["key_schema"] in current]
    unseeded = sorted((row for row in rows if row["seed"] is None), key=lambda row: str(row["run_name"]))
    rows = [row for row in rows if row["seed"] is not None]
    if not rows:
        raise StudyError("experiment", f"MLflow experiment {experiment!r} holds no training runs"
                         + (f" of this version: {left_out}" if other else ""),
                         f"launch it first (`study launch {experiment}`), then report")
    frame = pd.DataFrame(rows).drop(columns=["key_schema", "seed_tag"]).sort_values(["start_time", "run_id"])
    frame = frame[frame["run_key"].isna() | ~frame.duplicated("run_key")]
    fixed = [c for c in frame.columns if "/" not in c]
    metrics = sorted(c for c in frame.columns if "/" in c)
    frame = frame[fixed + metrics].sort_values(["scale", "variant", "seed"], ignore_index=True)
    trunk_runs = frame.loc[frame["role"] == Role.trunk].set_index("run_key")["run_id"]
    frame.insert(frame.columns.get_loc("trunk_key") + 1, "trunk_run_id",
                 [trunk_runs.get(k) if isinstance(k, str) else None for k in frame["trunk_key"]])
    manifest = read_manifest_tags(store, experiment)
    launched = set(manifest["keys"]) if manifest is not None else set()

    def latest(kind: pd.DataFrame) -> pd.DataFrame:
        mine = kind["run_key"].isin(launched)
        return kind[mine].reset_index(drop=True) if mine.any() else kind.reset_index(drop=True)

    tune_runs = frame["role"] == Role.tune
    main = frame[~tune_runs & (frame["role"] != Role.trunk)]
    tuned = latest(main[main["lr_source"] == TUNED])
    shared = main[main["lr_source"] != TUNED]
    # beside tuned runs, the shared-LR runs are an earlier launch's: a tuning launch trains none, and the shared-LR
    # keys it names are tune points that found a finished run of the same key (multiple 1 at a main run's seed and
    # scale), so narrowing to them would keep those seeds alone and drop every other shared seed
    shared = shared.reset_index(drop=True) if len(tuned) else latest(shared)
    tune = latest(frame[tune_runs])
    beside = bool(len(tuned) and len(shared))  # shared-LR runs decided beside the tuned ones
    runs, branches, unbranched = _branch_ends(tuned if len(tuned) else shared)
    if beside:
        shared = _branch_ends(shared)[0]
    if not len(runs):
        trunks = (frame["role"] == Role.trunk).any()
        raise StudyError("experiment", f"MLflow experiment {experiment!r} holds only "
                         + ("tune runs and the trunks of decay branches" if trunks else "tune runs"),
                         f"let the main runs (or the branches) train (`study launch {experiment}`), then report")
    if (runs["status"] == "FAILED").all():
        named = "; ".join(f"{r.run_name}: {r.failure_reason or 'no reason recorded'}"
                          for r in runs.head(3).itertuples())
        raise StudyError(
            "experiment",
            f"every training run of MLflow experiment {experiment!r} failed ({len(runs)} FAILED; {named}"
            + ("; ..." if len(runs) > 3 else "") + ")",
            f"each run's reason is its MLflow tag {schema.TAG_FAILURE_REASON} and its job output is among its "
            f"artifacts (`study status {experiment}` lists the runs); fix the cause and relaunch "
            f"(`study launch {experiment}`)")
    runs, diverged = _without_infinite_finals(runs)
    if len(branches):  # the branch ends decided on are among the branches: their note names each diverged one once
        branches, diverged = _without_infinite_finals(branches)
    if beside:
        shared, also = _without_infinite_finals(shared)
        diverged = " ".join(n for n in (diverged, also) if n)
    cells = set(zip(runs["variant"], runs["scale"]))
    missing = [f"{v} at {s}" for s in scale_order(runs) for v in sorted(set(runs["variant"])) if (v, s) not in cells]
    bad_seeds = (f"Left out {len(unseeded)} run(s) whose {schema.TAG_SEED} tag is not a whole number: "
                 + ", ".join(f"{r['run_name']} ({schema.TAG_SEED}={r['seed_tag']!r})" for r in unseeded)
                 + "; set the tag to the run's seed in MLflow, or delete the run" if unseeded else "")
    notes = tuple(note for note in (_branched(runs, branches), unbranched, _differences(runs), left_out, bad_seeds,
                                    diverged, "No run of " + ", ".join(missing) + ": these cells are in no comparison"
                                    if missing else "") if note)
    return StudyRuns(runs, shared if beside else None, tune, branches, notes)


def _branch_ends(main: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """(the runs to decide on, every decay branch, the note naming runs left out) of one LR source: ``main`` itself
    without branches, else the branches at the largest point (the planned runs' ends, paired by seed like straight
    runs), main runs that are no branch left out and named."""
    is_branch = main["role"] == Role.branch
    branches = main[is_branch].reset_index(drop=True)
    if not len(branches):
        return main, branches, ""
    ends = branches[branches["at"] == branches["at"].max()].reset_index(drop=True)
    others = main[~is_branch]
    note = (f"Left out {len(others)} run(s) that are no decay branch beside the branches decided on: "
            + ", ".join(map(str, others["run_name"].head(5))) + (", ..." if len(others) > 5 else "")
            if len(others) else "")
    return ends, branches, note


def _branched(runs: pd.DataFrame, branches: pd.DataFrame) -> str:
    """The sentence saying that the runs decided on are branch ends, when they are."""
    if not len(branches):
        return ""
    points = ", ".join(f"{at:g}" for at in sorted(branches["at"].dropna().unique()))
    return (f"Decay branches: the runs decided on are the {len(runs)} branches at the largest point "
            f"(at = {runs['at'].max():g} of the planned tokens); the {len(branches)} branches at every point "
            f"(at = {points}) are the points of the fits of loss against tokens (and parameters); the trunks are in "
            "no comparison.")


def _without_infinite_finals(runs: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The runs with every infinite or NaN final taken as not logged (no paired interval or fit can hold one: the run
    is unpaired there, with its reason), and the note naming them, since leaving them out favours their variant."""
    metrics = [c for c in runs.columns if "/" in c]
    values = runs[metrics].apply(pd.to_numeric, errors="coerce")
    # MLflow's SQL stores keep an infinity as the largest float
    infinite = values.abs() >= sys.float_info.max
    bad = runs[metrics].notna() & (infinite | values.isna())
    if not bad.to_numpy().any():
        return runs, ""
    shown = values.mask(infinite, np.sign(values) * math.inf)
    named = [f"{runs.at[i, 'run_name']} ({', '.join(f'{m} = {shown.at[i, m]}' for m in metrics if bad.at[i, m])})"
             for i in runs.index[bad.any(axis=1)]]
    note = (f"Left out of the comparisons and figures on those metrics, as not reached: {len(named)} run(s) whose "
            f"final value is infinite or NaN (the run diverged): {'; '.join(named)}. Leaving a diverged seed out "
            "favours its variant: look at its curve before trusting that variant's verdict")
    runs = runs.copy()
    runs[metrics] = runs[metrics].mask(bad)
    return runs, note


def _shared(dotted: str) -> bool:
    try:
        return is_shared(dotted)
    except KeyError:  # a param no config field places (recipe.*, resolved.*): the run's own, not the comparison's
        return False


def _differences(runs: pd.DataFrame) -> str:
    """The sentence naming each shared field (study.plan.fairness) in which a variant's runs differ from the baseline's
    at the same scale and seed (its `compares:` block), as the runs logged them."""
    fields = {(r.scale, r.variant, r.seed): json.loads(r.shared_fields) for r in runs.itertuples()}
    found: dict[tuple[str, str], dict[str, tuple[str, str, str]]] = {}
    for r in runs.itertuples():
        base = fields.get((r.scale, r.baseline, r.seed))
        if r.variant == r.baseline or base is None:
            continue
        mine = fields[(r.scale, r.variant, r.seed)]
        for name in sorted(set(mine) | set(base)):
            if mine.get(name) != base.get(name):
                found.setdefault((r.variant, r.scale), {}).setdefault(
                    name, (str(mine.get(name)), str(r.baseline), str(base.get(name))))
    if not found:
        return ""
    return ("Beyond their models, the arms differ in fields a comparison otherwise shares (declared in the "
            "experiment's compares:): " + "; ".join(
                f"{variant} at {scale}: " + ", ".join(f"{name} = {mine} against {baseline}'s {base}"
                                                     for name, (mine, baseline, base) in diffs.items())
                for (variant, scale), diffs in found.items()))


def _row(run) -> dict | None:
    """One row of the runs table (the read_study columns, then the finals); None for a run that is no training run."""
    tags, params = run.data.tags, run.data.params
    role = role_of(tags)
    if role in NOT_TRAINING or any(t not in tags for t in _REQUIRED_TAGS):
        return None
    counted = _number(params, "params.counted")
    batch = _first(params, "recipe.global_batch", "train.global_batch")
    seed = tags[schema.TAG_SEED]
    row = {
        "run_id": run.info.run_id, "run_name": run.info.run_name, "run_key": tags.get(schema.TAG_RUN_KEY),
        "key_schema": tags.get(TAG_KEY_SCHEMA), "variant": tags[schema.TAG_VARIANT], "scale": tags[schema.TAG_SCALE],
        "seed": int(seed) if re.fullmatch(r"\d+", seed) else None, "seed_tag": seed, "role": role,
        "baseline": tags.get(schema.TAG_BASELINE), "status": run.info.status,
        "failure_reason": tags.get(schema.TAG_FAILURE_REASON), "start_time": run.info.start_time,
        "params_counted": int(counted) if math.isfinite(counted) else math.nan,
        "lr_source": tags.get(schema.TAG_LR_SOURCE) or SHARED, "tune_multiple": _number(tags, schema.TAG_TUNE_MULTIPLE),
        "tune_status": tags.get(schema.TAG_TUNE_STATUS),
        # a tune run trains at its grid point (train.lr); a main run at its resolved recipe's LR
        "lr": _number(params, "train.lr" if role == Role.tune else "recipe.lr"),
        "tokens": _number(params, "recipe.tokens"), "max_steps": _first(params, "recipe.max_steps", "train.max_steps"),
        # the recipe's rule for the global batch: train.global_batch, else micro batch x accumulation
        "global_batch": batch if math.isfinite(batch)
        else _number(params, "train.micro_batch") * _number(params, "train.grad_accum"),
        "seq_len": _number(params, "data.seq_len"), "flops_per_token": _number(params, "resolved.flops_per_token"),
        "at": _number(tags, TAG_BRANCH_AT), "trunk_key": tags.get(TAG_TRUNK_KEY),
        "branch_step": _number(tags, TAG_BRANCH_STEP),
        "shared_fields": json.dumps({k: v for k, v in params.items() if _shared(k)}, sort_keys=True),
    }
    row.update(run.data.metrics)
    return row


def _number(values: Mapping[str, str], key: str) -> float:
    """``values[key]`` as a float; NaN when absent or not a number (MLflow logs a None as the string "None")."""
    try:
        return float(values[key])
    except (KeyError, TypeError, ValueError):
        return math.nan


def _first(values: Mapping[str, str], *keys: str) -> float:
    """The first of ``keys`` logged with a positive value (a config's 0 means "derive it"), else NaN."""
    for key in keys:
        value = _number(values, key)
        if value > 0:
            return value
    return math.nan


def trunk_links(runs: pd.DataFrame) -> dict[str, tuple[str, int]]:
    """Run id of each decay branch among ``runs`` whose trunk's run is stored -> (that run's id, the branch's start)."""
    if "trunk_run_id" not in runs.columns:
        return {}
    linked = runs[runs["trunk_run_id"].notna() & np.isfinite(runs["branch_step"].to_numpy(float))]
    return {r.run_id: (r.trunk_run_id, int(r.branch_step)) for r in linked.itertuples()}


def read_curves(run_ids: Iterable[str], metric: str = "val/loss", tracking_uri: str | None = None,
                trunks: Mapping[str, tuple[str, int]] | None = None) -> pd.DataFrame:
    """Full history of ``metric`` for each run, long form: columns run_id, step, value. ``trunks``
    (:func:`trunk_links`) prefixes a branch's history with its trunk's points up to its start, so its curve is the
    straight WSD run's it equals, from step 0. Four threads overlap the per-run round trips to a tracking server.
    """
    store = open_store(tracking_uri, required=True)
    ids = list(run_ids)
    links = {rid: trunks[rid] for rid in ids if trunks and rid in trunks}
    wanted = list(dict.fromkeys([*ids, *(trunk for trunk, _ in links.values())]))
    with ThreadPoolExecutor(max_workers=4) as pool:
        histories = dict(zip(wanted, pool.map(lambda rid: store.get_metric_history(rid, metric), wanted),
                             strict=True))
    records = [(rid, m.step, m.value, m.timestamp) for rid in ids for m in histories[rid]]
    records += [(rid, m.step, m.value, m.timestamp) for rid, (trunk, start) in links.items()
                for m in histories[trunk] if m.step <= start]
    curves = pd.DataFrame(records, columns=["run_id", "step", "value", "timestamp"])
    # A resumed run can re-log a step; its latest value wins, as it does for the final.
    curves = curves.sort_values("timestamp").drop_duplicates(["run_id", "step"], keep="last")
    return curves.drop(columns="timestamp").sort_values(["run_id", "step"], ignore_index=True)


def scale_order(runs: pd.DataFrame) -> list[str]:
    """Scales from small to large: by median counted parameters, else by the size in the name, else by name."""

    def key(scale: str) -> tuple[float, float, str]:
        counted = runs.loc[runs["scale"] == scale, "params_counted"].median()
        match = re.search(r"(\d+(?:\.\d+)?)\s*([kmbgt]?)", scale.lower())
        from_name = float(match.group(1)) * _SCALE_SUFFIX[match.group(2)] if match else math.inf
        return (counted if pd.notna(counted) else math.inf, from_name, scale)

    return sorted(runs["scale"].unique(), key=key)
