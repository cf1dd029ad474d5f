"""Racing at run time (`racing:` in an experiment with branches): the glue between the launch and the race's
decisions (analysis.racing). The launch writes the race's roster, `_launch/racing.json`. `settle`, called by every
finishing branch's job and by a local launch after each batch of branches, decides under `_launch/racing.lock` each
rung whose branches all have their `result.json`, and appends its verdicts to `_launch/racing.jsonl`. An arm decided
worse (or equivalent, with `stop_equivalent`) stops: the SLURM jobs of its trunks and later branches are cancelled and
no launch submits them again (`stopped_keys`). A branch that fails never settles, so its rung is never decided: racing
only trains less once it has decided. The race's record goes to MLflow as the experiment's `racing` run."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from analysis.racing import RACE_ARTIFACT, decide_ready, line_problem, race_record
from study.config.decision import DecisionRule
from study.config.run import Role
from study.config.spec import DIVERGED, read_result
from study.errors import StudyError
from study.files import (COUNT, FLAG, LIST, MAPPING, NUMBER, NUMBERS, TEXT, damaged, file_lock, optional,
                         read_json_lines, read_mapping, replace_file, shape_problem)
from study.launch.scheduler import ACTIVE, append_lines, journal, slurm_states
from study.schema import ROLE_RACING, TAG_ROLE, RunDir, launch_dir

ROSTER, RECORD, LOCK = "racing.json", "racing.jsonl", "racing.lock"


def write_roster(plan) -> Path | None:
    """The race's roster from the launch's plan (None, and nothing written, when the experiment does not race)."""
    exp = plan.experiment
    if exp.racing is None or exp.branches is None:
        return None
    runs = [{"key": r.key, "role": r.role.value, "variant": r.config.variant, "scale": r.config.scale,
             "seed": r.config.seed, "trunk": r.trunk, "at": r.points[0].at if r.role == Role.branch else None,
             "starts": [p.start for p in r.points], "gpu_hours": r.gpu_hours()}
            for r in plan.runs if r.role in (Role.trunk, Role.branch)]
    roster = {"baseline": exp.baseline, "at": list(exp.branches.at), "decay": exp.branches.decay,
              "stop_equivalent": exp.racing.stop_equivalent, "decision": asdict(exp.decision), "runs": runs}
    path = launch_dir(plan.runs[0].config.paths.runs, exp.name) / ROSTER
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, json.dumps(roster, indent=1))
    return path


_ROSTER = {"baseline": TEXT, "at": NUMBERS, "stop_equivalent": FLAG, "decision": MAPPING, "runs": LIST}
_ROSTER_RUN = {"key": TEXT, "role": TEXT, "variant": TEXT, "scale": TEXT, "seed": COUNT, "trunk": optional(TEXT),
               "at": optional(NUMBER), "starts": NUMBERS, "gpu_hours": optional(NUMBER)}


def decided(runs_root: str, experiment: str) -> list[dict]:
    """Every verdict recorded so far, in the order the rungs were decided (a rung whose line a killed job cut short
    is decided again by the next settle). A line edited or damaged by hand is refused by name."""
    path = launch_dir(runs_root, experiment) / RECORD
    fix = (f"delete the damaged line of {path} (or the whole file): the rungs it no longer records are decided again "
           "from their branches' result.json when the next branch finishes or a local launch settles")
    return read_json_lines(path, fix, line_problem)


def _read_roster(path: Path) -> dict:
    """The race's roster, its fields checked (the decision rule as an experiment file's is)."""
    fix = f"delete {path}: the next `study launch` of the experiment writes it again from its plan"
    roster = read_mapping(path, _ROSTER, fix)
    for i, run in enumerate(roster["runs"]):
        if problem := shape_problem(run, _ROSTER_RUN):
            raise damaged(path, f"runs[{i}] {problem}", fix)
    try:
        DecisionRule.from_mapping(roster["decision"])
    except StudyError as err:
        raise damaged(path, f"`{err.field}` {err.problem}", fix) from None
    return roster


def stopped_keys(plan) -> dict[str, str]:
    """Run key -> why it is not trained: the trunks and the later branches of every arm the race stopped."""
    if plan.experiment.racing is None or not plan.runs:
        return {}
    stops = {(v["variant"], v["scale"]): v for v in decided(plan.runs[0].config.paths.runs, plan.experiment.name)
             if v.get("stops")}  # (variant, scale) -> the verdict that stopped it
    out = {}
    for r in plan.runs:
        v = stops.get((r.config.variant, r.config.scale))
        if v is not None and (r.role == Role.trunk or r.role == Role.branch and r.points[0].at > v["at"]):
            out[r.key] = (f"stopped by racing at branch point {v['at']:g}: {v['verdict']} than {v['baseline']} "
                          f"(Δ {v['mean_delta']:+.4g}, interval [{v['ci_low']:.4g}, {v['ci_high']:.4g}] at alpha "
                          f"{v['alpha']:.3g})")
    return out


def settle(runs_root: str, experiment: str, tracking_uri: str = "") -> list[dict]:
    """Decide every rung that is ready and not yet decided, stop what it stops; returns the new verdicts."""
    folder = launch_dir(runs_root, experiment)
    if not (folder / ROSTER).exists():
        return []
    with file_lock(folder / LOCK):
        roster = _read_roster(folder / ROSTER)
        new = decide_ready(roster, decided(runs_root, experiment), lambda key: _endpoint(runs_root, experiment, key))
        if new:
            append_lines(folder / RECORD, new)
    if new:
        _cancel_stopped(roster, runs_root, experiment, [v for v in new if v["stops"]])
        _to_mlflow(roster, runs_root, experiment, tracking_uri)
    return new


def _endpoint(runs_root: str, experiment: str, key: str) -> float | None:
    """A branch's final val_loss, None until it has finished (or where it diverged)."""
    result = read_result(RunDir.of(runs_root, experiment, key).result, key)
    return None if result is None or result.get(DIVERGED) else float(result["val_loss"])


def _cancel_stopped(roster: dict, runs_root: str, experiment: str, stops: list[dict]) -> None:
    """Cancel the SLURM jobs of the stopped arms' trunks and later branches (local runs are skipped by the launch)."""
    arms = {(v["variant"], v["scale"]): v["at"] for v in stops}
    keys = {r["key"] for r in roster["runs"] if (r["variant"], r["scale"]) in arms
            and (r["role"] == Role.trunk.value or r["at"] > arms[(r["variant"], r["scale"])])}
    jobs = journal(runs_root, experiment)
    ids = [jobs[k]["job_id"] for k in keys if k in jobs and jobs[k].get("scheduler") == "slurm"]
    live = [j for j, state in slurm_states(ids).items() if state in ACTIVE]
    if live:
        # TERM first: a trunk checkpoints and stops (scancel's default signal, then KILL after SLURM's KillWait)
        subprocess.run(["scancel", *live], capture_output=True, text=True)


def _to_mlflow(roster: dict, runs_root: str, experiment: str, tracking_uri: str) -> None:
    """The race so far as the experiment's `racing` run (artifact RACE_ARTIFACT); a store that does not answer is
    left for the next settle (the run directory's record is what acts)."""
    from study.track.query import runs_with_role
    from study.track.store import get_or_create_experiment, mlflow_client, resolve_tracking_uri

    try:
        uri = resolve_tracking_uri(tracking_uri)
        client = mlflow_client(uri)
        exp_id = get_or_create_experiment(client, uri, experiment)
        found = runs_with_role(client, [exp_id], ROLE_RACING, max_results=1)
        run_id = (found[0].info.run_id if found else
                  client.create_run(exp_id, run_name="racing", tags={TAG_ROLE: ROLE_RACING}).info.run_id)
        client.log_dict(run_id, race_record(roster, decided(runs_root, experiment)), RACE_ARTIFACT)
        client.set_terminated(run_id, "FINISHED")
    except Exception as err:  # noqa: BLE001 - the record in the run directory stands; the report waits for the next
        print(f"racing: the record did not reach MLflow ({type(err).__name__}: {err})", file=sys.stderr)
