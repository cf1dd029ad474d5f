"""What a training run tells MLflow beyond its metrics: params, tags, lineage at its start, its job log at the end."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from study import schema
from study.config.identity import KEY, SCHEDULED, placement
from study.config.run import Role
from study.config.secrets import redact
from study.config.spec import RunSpec, finished_loss
from study.errors import StudyError
from study.track import lineage
from study.track.groups import parent_for, share_datasets
from study.track.store import find_runs
from study.track.tracker import NullTracker, Tracker, flatten
from study.train.distributed import Dist, hosts
from study.train.parallelize import layout_name

MAX_LOG_ARTIFACT = 64 << 20
"""Largest job log copied to MLflow at the end of a run."""


def open_tracker(spec: RunSpec, d: Dist, data, start: int):
    """The run's MLflow run, opened or resumed at step `start`, with its params, tags, lineage (parent run, dataset
    input) and the artifacts a reader of the run page wants (config, spec, parameter table, tokenizer). A key that
    FINISHED in another run directory is refused (`finished_elsewhere`)."""
    ran_on = hosts(d)  # collective: before rank 0 alone talks to MLflow
    print(f"study: {spec.name} rank {d.rank} of {d.world_size} on host {ran_on[d.rank]}", file=sys.stderr, flush=True)
    if not d.is_main:  # only rank 0 talks to MLflow: the others build nothing for it
        return NullTracker()
    cfg, m = spec.config, spec.model
    # the config fields the key hashes, and nothing else: a resume with another cadence, MFU estimate or device
    # (placed out of the key) is the same run, and a param logged once cannot change value in MLflow
    sides = (KEY, SCHEDULED) if m.ffn.schedule.family == "geometry" else (KEY,)
    params = {k: v for k, v in flatten(asdict(cfg)).items() if placement(k)[0] in sides}
    params["resolved"] = {"n_layers": m.n_layers, "d_model": m.d_model, "n_heads": m.n_heads,
                          **({"layer_heads": m.layer_heads} if m.layer_heads is not None else {}),
                          "ffn_widths": m.ffn.widths, "flops_per_token": spec.flops_per_token}
    # the recipe as planned: a resume on another world size splits the same global batch, so its params stay valid
    # validation's window count is no training setting: left out like the layout (and absent from older specs)
    params["recipe"] = {k: v for k, v in asdict(spec.planned).items() if k not in ("micro_batch", "grad_accum",
                                                                                   "world_size", "val_windows")}
    params["params"] = spec.params
    tags = {**lineage.run_tags(spec), schema.TAG_WORLD_SIZE: str(d.world_size), **lineage.source_tags(),
            lineage.DESCRIPTION: lineage.description(spec)}
    tracker = Tracker.open(spec.key, cfg.experiment, spec.name, tags, redact(params), cfg=cfg.tracking,
                           log_path=spec.run_dir.metrics, system_metrics=cfg.tracking.system_metrics_s > 0,
                           check=lambda client, run: finished_elsewhere(spec, start, client, run))
    import yaml

    def lineage_records(client, run_id):
        run = client.get_run(run_id)
        parent = None
        if spec.role == Role.branch:  # a branch nests under its trunk, which nests under its (variant, scale)
            trunk = find_runs(client, run.info.experiment_id, str(spec.trunk))  # it trained to the branch's start
            if trunk:
                client.set_tag(run_id, lineage.PARENT, trunk[0].info.run_id)
        elif spec.role != Role.calibrate:  # a calibration measures a shape: it has no seeds to group
            parent = parent_for(client, run.info.experiment_id, run.data.tags)
            client.set_tag(run_id, lineage.PARENT, parent)
        dataset = lineage.dataset_input(data, cfg.data)
        if all(i.dataset.digest != dataset.dataset.digest for i in run.inputs.dataset_inputs):
            client.log_inputs(run_id, datasets=[dataset])  # once: a resumed run trains on the same shards
        if parent is not None:  # the parent shows the shards its cell trains on from the first seed's start
            share_datasets(client, parent, [client.get_run(run_id)])

    tracker.record("lineage", lineage_records)
    segment = f"from step {start}: {layout_name(cfg, d)}"

    def layout_records(client, run_id):
        """The hosts and layouts of every start, earlier starts' kept: a resume may train on other hosts, or another
        layout. A start from an earlier step (a restart) replaces what came after it."""
        tags = client.get_run(run_id).data.tags
        seen = [h for h in tags.get(schema.TAG_HOSTS, "").split(",") if h]
        client.set_tag(run_id, schema.TAG_HOSTS, ",".join(dict.fromkeys([*seen, *ran_on])))
        earlier = [s for s in tags.get(schema.TAG_LAYOUT, "").split("; ") if s.startswith("from step ")
                   and int(s[len("from step "):].split(":")[0]) < start]
        client.set_tag(run_id, schema.TAG_LAYOUT, "; ".join([*earlier, segment]))

    tracker.record("layout", layout_records)
    tracker.log_artifact(Path(data.tokenizer_path), "tokenizer/tokenizer.json")

    tracker.log_dict(redact(asdict(cfg)), "config.yaml")
    tracker.log_dict(redact(spec.as_dict()), "run.json")
    tracker.log_dict({"run_key": spec.key, "budget": spec.budget, "mismatch": spec.mismatch,
                      "params": spec.params, "ffn_widths": m.ffn.widths}, "param_table.json")
    spec.run_dir.config.write_text(yaml.safe_dump(redact(asdict(cfg)), sort_keys=False))
    return tracker


def finished_elsewhere(spec: RunSpec, start: int, client, run) -> None:
    """Refuse to resume the key's MLflow run when it FINISHED but this run directory, starting at step `start`,
    holds neither its result nor its final checkpoint (it finished under another `paths.runs`, or this one lost
    them): training here would reopen a result of record, and a failure would mark it FAILED for the report."""
    if run.info.status != "FINISHED" or finished_loss(spec) is not None or start >= spec.last_step:
        return
    here = spec.run_dir.path
    try:  # the run directory its `run.json` artifact names (the spec's `dir`)
        with tempfile.TemporaryDirectory() as tmp:
            where = json.loads(Path(client.download_artifacts(run.info.run_id, "run.json", tmp)).read_text()).get("dir")
    except Exception:  # noqa: BLE001 - a missing, unreadable or unreachable artifact: the directory is not recorded
        where = None
    if where is None:
        at, root = "in a run directory its MLflow run does not record", "its runs folder"
    elif Path(where) == here:
        at, root = ("in this run directory, which no longer holds its result.json or final checkpoint",
                    str(here.parent.parent))
    else:
        at, root = f"in {where}", str(Path(where).parent.parent)
    raise StudyError("paths.runs", f"run {spec.key} has FINISHED {at} (MLflow run {run.info.run_id}); training it "
                     f"in {here} would reopen that result of record", f"use the finished run where it is (report, "
                     f"eval and export read it with paths.runs={root}); or train it again from step 0 with "
                     "`study train ... --restart`, which sets that MLflow run aside and replaces its result")


def log_job_output(tracker, spec: RunSpec) -> None:
    """The job's own stdout and stderr, when they go to files (a SLURM or local-launch log), as artifacts
    `logs/<name>`: the run page then holds what the job printed, progress and warnings included."""
    if tracker.run_id is None:
        return
    seen = set()
    for fd in (1, 2):
        try:
            path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            return  # no /proc: not Linux
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        if path.stat().st_size > MAX_LOG_ARTIFACT:
            print(f"the job log {path} is over {MAX_LOG_ARTIFACT >> 20} MiB: not copied to MLflow", flush=True)
            continue
        sys.stdout.flush(), sys.stderr.flush()
        try:
            tracker.log_artifact(path, f"logs/{path.name}")
        except OSError as exc:
            print(f"the job log {path} could not be copied to MLflow: {exc}", file=sys.stderr, flush=True)
