"""One training run from its run spec: data, (FSDP) model, AdamW, periodic validation and checkpoints, exact
resume, MLflow (what a run tells it beyond its metrics: study.train.tracking), and what the trainer does to its run
directory (claimed for its key, the data it started on recorded and checked, the tokenizer kept, a full disk named as
the user's problem).

    study train experiment=demo variant=hourglass seed=0      # one process
    study train experiment=demo variant=hourglass --nproc 2   # FSDP2 over gloo (CPU) or NCCL (GPU)
    python -m study.train -m hydra/launcher=submitit_slurm scale=tiny seed=0,1   # Hydra multirun

The spec says what to build and how to train it; nothing is re-planned here. Resume is exact: the batch of step s is
a pure function of (seed, s), the LR a function of s, and the checkpoint holds model, optimizer, RNG and the
`TrainState`, so a restarted run recomputes bit-identical losses (fp32 on CPU) and tracking drops the repeats. A step
is the optimizer step, then the callbacks (study.train.callbacks); the device layout is study.train.parallelize's.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from study import schema
from study.config.data import tokenize_procs
from study.config.identity import json_digest
from study.config.recipe import batch_layout
from study.config.run import Role
from study.config.spec import DIVERGED, RunSpec, held_spec, write_spec
from study.errors import StudyError
from study.files import Kind, read_mapping, replace_file
from study.schema import RunDir, not_a_link
from study.track.groups import refresh
from study.train import checkpoint
from study.train import restart as restarts
from study.train.callbacks import (Checkpointing, Diverged, FaultHooks, Metrics, Progress, Run, StepOutput,
                                   Validation)
from study.train.distributed import Dist, all_reduce_max, barrier, keep_freed_memory, setup
from study.train.lease import acquire
from study.train.parallelize import autocast_bf16, compute_dtype, parallelize
from study.train.signals import StopRequest
from study.train.state import TrainState
from study.train.step import train_step
from study.train.tracking import log_job_output, open_tracker

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: the run saved its state and wants to be started again
DATA_RECORD = "data.json"


@dataclass
class Outcome:
    status: str
    """FINISHED, FAILED, PREEMPTED, or DIVERGED (a tune run whose loss went non-finite: its result)."""
    step: int
    """Last completed step."""
    val_loss: float | None
    """Final validation loss (None unless FINISHED)."""
    losses: dict[int, float]
    """Training loss per step computed in this process (for tests and the report)."""
    reason: str | None = None
    """Why the run did not finish."""


def batch_stream(spec: RunSpec, data, d: Dist, start: int):
    """Batches depend on the seed, the step and the global batch only, never on the architecture or the world size:
    paired runs see the same data."""
    from study.data import BatchStream

    micro, accum = layout(spec, d)
    return BatchStream(data.train, data.seq_len, spec.config.order_seed, micro, accum, d.rank, d.world_size, start,
                       d.device)


def layout(spec: RunSpec, d: Dist) -> tuple[int, int]:
    """(micro batch, accumulation steps) per rank that split the recipe's global batch over this job's ranks: the
    plan's own split at the planned world size, else the one rule the plan splits by (`batch_layout`)."""
    r = spec.planned
    if d.world_size == r.world_size:
        return r.micro_batch, r.grad_accum
    return batch_layout(r.global_batch, spec.config.train.micro_batch, d.world_size, "world size")


def train(spec: RunSpec, restart: bool = False, at_branch_start=None) -> Outcome:
    """Train (or resume) the run the spec describes, holding its run directory's lease; with `restart`, from step 0,
    its earlier training set aside. Collective when world size > 1. A trunk calls `at_branch_start(step)` on rank 0
    once its checkpoint at a branch start is complete (a launch then releases the branches waiting for it)."""
    if spec.awaits_tuning:
        raise StudyError("tune", f"run {spec.name} ({spec.key}) trains at the LR its variant's tuning chooses, which "
                         f"has not decided yet ({spec.pending})", f"launch the experiment (study launch "
                         f"{spec.config.experiment}): it trains the tune runs first, then this one")
    d = setup(spec.config.train.device, spec.config.train.collective_timeout_s)
    rdir = spec.run_dir.path
    if d.is_main:  # fail before anything is tracked when the run directory cannot hold checkpoints
        try:
            rdir.mkdir(parents=True, exist_ok=True)
            probe = rdir / f".write-probe-{os.getpid()}"  # one per process: trainers may race here
            probe.write_bytes(b"x" * 4096)
            probe.unlink()
        except OSError as err:
            fix = ("free space on that file system or point paths.runs elsewhere" if err.errno == errno.ENOSPC
                   else "point paths.runs at a writable directory (shared between nodes on a cluster)")
            raise StudyError("paths.runs", f"cannot write the run directory {rdir} ({os.strerror(err.errno or 0)})",
                             fix) from None
    lease = acquire(rdir, spec.key, d)
    try:
        if d.is_main:
            held_spec(spec)  # the run directory holds this run's spec, never another's
            write_spec(spec)  # the run directory always holds the spec that trained it
            interrupted = restarts.interrupted(spec)
            if restart or interrupted is not None:
                restarts.restart(spec, interrupted)
        barrier(d)  # every rank looks for checkpoints after a restart has set them aside
        return _train(spec, d, at_branch_start)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):  # the file system (or the user's quota on it) is full
            raise
        # the user's error: where, how much is free, what to free, where a restart resumes
        last = checkpoint.latest(rdir)
        raise StudyError("paths.runs", f"no space left on {rdir} (writing {err.filename or 'to it'}; "
                         f"{shutil.disk_usage(rdir).free >> 20} MiB free on its file system)",
                         "free space on that file system (other runs' old checkpoints, or a lower train.keep_last), or "
                         "move the runs folder to one with room and point paths.runs there; started again, the run "
                         f"resumes from {last.name if last else 'step 0'}") from None
    finally:
        if lease is not None:
            lease.release()


def _data(spec: RunSpec, d: Dist, micro: int):
    """The run's data, checked against its validation batch and against the data it started on."""
    from study.data import prepare_data
    from study.data.batches import check_val_split
    from study.data.tokenizer import TOKENIZER_CONFIG, load_tokenizer

    cfg = spec.config
    data = prepare_data(cfg.data, model_vocab=spec.model.vocab_size)
    check_val_split(data.val, data.seq_len, micro * d.world_size, from_files=bool(cfg.data.val_tokens))
    check_data(spec, data, write=d.rank == 0)  # before the tokenizer copy: a start on other data leaves it as it is
    if d.rank == 0:
        # the run directory keeps the tokenizer it was trained with, and the token that ended its documents in
        # tokenizer_config.json beside it (as transformers declares one), so evaluation and export never need the data
        # or its source directory again: a transformers directory's declared EOS is not among the tokenizer's own
        source, copy = Path(data.tokenizer_path), spec.run_dir.tokenizer
        config = json.dumps({"eos_token": load_tokenizer(source).id_to_token(data.eos_id)}).encode()
        for path, content in ((copy, source.read_bytes()), (copy.with_name(TOKENIZER_CONFIG), config)):
            if not (path.is_file() and path.read_bytes() == content):
                replace_file(path, content)
    return data


def record_path(spec: RunSpec) -> Path:
    return not_a_link(spec.run_dir.path / DATA_RECORD)


def check_data(spec: RunSpec, data, write: bool) -> None:
    """Refuse a start on other data than the run started on: the SHA-256 of its token files and tokenizer (the
    prepared data's meta.json `sha256`), recorded in the run directory (`data.json`) on its first start (when `write`:
    rank 0) and compared on every later one. A run directory from before the record has its tokenizer copy as the
    only witness.

    The run key names the corpus (a path, a hub dataset), not its content, and a cache that sees the corpus change
    tokenises it again (perhaps with a newly trained BPE): a checkpoint continued on it would read token ids that now
    mean other strings; `--restart` trains again from step 0 instead. Flat token files (`data.tokens`) are read in
    place and a rewrite can keep their size and modification time, so the record also holds each one's sampled content
    digest (study.data.flat.spot_digest), computed again on every start; a record from before these digests gains
    them at the run's next start."""
    from study.data.flat import spot_digests

    path = record_path(spec)
    now = data.meta["sha256"]
    # the sampled content digest of every flat token file the data reads in place; none for token shards, which live
    # in the cache and are checked by their SHA-256
    files = (spot_digests([f["path"] for records in data.meta["files"].values() for f in records],
                          tokenize_procs(spec.config.data)) if data.meta.get("kind") == "flat" else {})
    if path.exists():
        # refused by name when damaged: the checksums it holds are what the data is compared with
        fix = (f"restore {path} from a copy; or train the run again from step 0 on the data as it is now "
               f"(`study launch EXPERIMENT --restart {spec.key}`)")
        digests = Kind("a mapping of file names to digests", lambda v: isinstance(v, dict) and all(
            isinstance(x, str) for x in v.values()))
        record = read_mapping(path, {"sha256": digests}, fix, {"files": digests})
        then = record["sha256"]
        changed = sorted(name for name in then.keys() | now.keys() if then.get(name) != now.get(name))
        if changed:
            _refuse_data(spec, data, f"{', '.join(changed)} of the prepared data ({data.shard_dir}) differ from the "
                         f"ones recorded in {path} when the run started")
        if "files" in record:
            moved = sorted(f for f in record["files"].keys() | files.keys() if record["files"].get(f) != files.get(f))
            if moved:
                _refuse_data(spec, data, f"the bytes of {', '.join(moved)} differ from the ones recorded in {path} "
                             "when the run started (their sampled content digests, study.data.flat.spot_digest), "
                             "whatever their size and modification time say")
        elif files and write:
            replace_file(path, json.dumps({**record, "files": files}, indent=1))
        return
    copy = spec.run_dir.tokenizer
    if copy.is_file() and copy.read_bytes() != Path(data.tokenizer_path).read_bytes():
        _refuse_data(spec, data, f"its tokenizer {data.tokenizer_path} differs from the run's copy {copy}")
    if write:
        record = {"run_key": spec.key, "name": spec.config.data.name, "shards": str(data.shard_dir), "sha256": now}
        replace_file(path, json.dumps({**record, "files": files} if files else record, indent=1))


def _refuse_data(spec: RunSpec, data, what: str) -> None:
    cfg = spec.config.data
    field = "data.tokens" if cfg.tokens else "data.name"
    raise StudyError(field, f"run {spec.key} started on other data than {cfg.name} holds now: {what}; its checkpoints "
                     "would continue on token ids that mean other strings",
                     "restore the data the run started on; or train the run again from step 0 on this data with "
                     f"`study train ... --restart` (`study launch EXPERIMENT --restart {spec.key}`), which sets its "
                     "checkpoints and MLflow run aside; or train this data as a new run (another experiment or seed)")


def _train(spec: RunSpec, d: Dist, at_branch_start=None) -> Outcome:
    import torch

    from study.models.transformer import build_model
    from study.train.optim import build_optimizer, build_scheduler

    cfg, key, recipe = spec.config, spec.key, spec.planned
    micro, _ = layout(spec, d)
    data = _data(spec, d, micro)
    if not d.device.startswith("cuda"):
        keep_freed_memory()
    torch.manual_seed(cfg.weights_seed)
    model = parallelize(build_model(spec.model, d.device, seed=cfg.weights_seed), cfg, d)
    optimizer = build_optimizer(model, cfg.train, recipe.lr)

    shape = json_digest(asdict(spec.model))  # a checkpoint of another model shape is refused
    state = (checkpoint.load_latest(spec.run_dir.path, model, optimizer, d, key, shape)
             or _branch_start(spec, model, optimizer, d)
             or TrainState(max_steps=recipe.max_steps, run_key=key))
    state.run_key, state.model_hash, state.compute_dtype = key, shape, compute_dtype(cfg, d)
    start = state.step
    scheduler = build_scheduler(optimizer, recipe, start)

    tracker = open_tracker(spec, d, data, start)
    stop = StopRequest.install()
    stream = batch_stream(spec, data, d, start)
    last = spec.last_step  # a trunk stops at its last branch start, its LR still stable
    run = Run(spec, d, tracker, state)
    faults = FaultHooks(cfg.faults)
    metrics = Metrics(run, scheduler, recipe.global_batch * data.seq_len, inject=faults.loss)
    # the order callbacks are called in at each hook (study.train.callbacks says which hook each one uses)
    run.callbacks = [metrics, Progress(d, start, last, spec.name, spec.run_dir.progress),
                     Validation(run, model, data, micro), faults,
                     Checkpointing(run, model, optimizer, at_branch_start)]
    bf16 = autocast_bf16(cfg, d)
    outcome = None
    try:
        for step in range(start + 1, last + 1):
            batches = next(stream)
            loss_sum, grad_norm = train_step(model, model, optimizer, scheduler, batches, d.device,
                                             cfg.train.z_loss, cfg.train.grad_clip, bf16, sharded=d.world_size > 1)
            run.call("on_step", step, StepOutput(loss_sum, len(batches), grad_norm))  # log, validate
            run.call("before_stop", step, stop)
            state.step = step
            stopping = all_reduce_max(float(stop.requested), d) > 0  # one rank's signal stops every rank
            run.call("on_step_end", step, stopping)  # checkpoint
            if stopping and step < last:
                reason = f"stopped by {stop.signal_name} at step {step}"
                outcome = Outcome("PREEMPTED", step, None, metrics.losses, reason)
                break
        else:
            outcome = Outcome("FINISHED", last, state.val_loss, metrics.losses)
    except Diverged as err:
        outcome = Outcome("DIVERGED" if spec.role == Role.tune else "FAILED", step, None, metrics.losses, str(err))
    except BaseException as err:
        log_job_output(tracker, spec)
        tracker.close("FAILED", f"{type(err).__name__}: {err}")
        raise
    finally:
        stream.close()
        run.call("close")
        stop.uninstall()
    _finish(outcome, tracker, spec, d)
    return outcome


def _branch_start(spec: RunSpec, model, optimizer, d: Dist) -> TrainState | None:
    """A decay branch without a checkpoint of its own starts from its trunk's at its branch step; others: None."""
    if spec.role != Role.branch:
        return None
    trunk_dir = RunDir.of(spec.config.paths.runs, spec.config.experiment, spec.trunk).path
    state = checkpoint.load_branch_start(trunk_dir, spec.first_step, model, optimizer, d, spec.trunk)
    state.val_loss = None  # the trunk's validation loss at its stable LR is none of the branch's results
    state.max_steps = spec.planned.max_steps
    return state


def _finish(outcome: Outcome, tracker, spec: RunSpec, d: Dist) -> None:
    if outcome.status == "PREEMPTED":
        tracker.log_metrics({schema.TRAIN_PREEMPTED_AT: outcome.step}, outcome.step)
        tracker.close("KILLED", outcome.reason)
        return
    # a final result: the run finished, or it is a tune run whose LR diverged (a result, never trained again:
    # study.plan.tune); written whole: a damaged result.json is refused by its readers, so a kill must never leave half
    # of one
    if outcome.status in ("FINISHED", "DIVERGED") and d.is_main:
        result = {"val_loss": outcome.val_loss, "step": outcome.step, "run_key": spec.key}
        replace_file(spec.run_dir.result, json.dumps(result | ({DIVERGED: outcome.reason}
                                                               if outcome.status == "DIVERGED" else {})))
    log_job_output(tracker, spec)
    # MLflow calls a diverged run FAILED, with the reason, whatever its role
    tracker.close("FAILED" if outcome.status == "DIVERGED" else outcome.status, outcome.reason)
    if outcome.status == "FINISHED":
        tracker.record("parent summary", refresh)  # a failure is logged: the seed runs hold every number it shows
