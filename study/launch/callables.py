"""What a launched job runs: the data preparation of a shard entry, training (then evaluation) of one run, the
geometry profile of a reference run (each job kind names its class: study.launch.kinds).

submitit pickles a callable and runs it on the node (or as a local process); it holds only its run directory and
reads the run spec there. On SIGUSR2/SIGTERM the training loop saves a checkpoint, then rank 0 requeues the SLURM job
while requeues remain; a requeued or restarted job resumes from its latest complete checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import submitit

from study.config.run import Role
from study.config.spec import RunSpec, read_spec, write_spec


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0


def _requeue_self(max_requeues: int) -> bool:
    """Requeue this SLURM job (rank 0 only) unless it has used its requeues. True when requeued."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or int(os.environ.get("SLURM_PROCID", "0")) != 0:
        return bool(job)
    if int(os.environ.get("SLURM_RESTART_COUNT", "0")) >= max_requeues:
        print(f"not requeued: {max_requeues} requeues used", file=sys.stderr)
        return False
    result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if result.returncode != 0:
        print(f"scontrol requeue {job} failed: {result.stderr.strip()}", file=sys.stderr)
        return False
    return True


@dataclass
class TrainJob(submitit.helpers.Checkpointable):
    """Train one run; evaluate it afterwards when `eval.after_train` is set.

    Checkpointable: a USR2 that lands before the training loop has taken over the signal (imports, data
    preparation, the final evaluation) makes submitit requeue the same job, which resumes from its checkpoint."""

    run_dir: str

    def __call__(self) -> dict:
        from study.train.signals import catch_early

        catch_early()  # first: a TERM from here on stops the run at a checkpoint, never lost to submitit
        import torch

        from study.train.distributed import teardown
        from study.train.loop import train

        spec = _completed(read_spec(self.run_dir))
        # one BLAS pool per rank sized to its CPUs: oversubscribed pools are slower than fewer threads
        torch.set_num_threads(max(1, spec.config.cluster.cpus_per_task))
        outcome = train(spec, at_branch_start=_branch_releaser(spec))
        teardown()
        if outcome.status == "PREEMPTED":
            # the checkpoint is saved: on a TERM, SLURM itself cancels or requeues the job; once requeued here, exit
            # without a result, as submitit does itself after a requeue
            if "TERM" in (outcome.reason or "") or _requeue_self(spec.config.cluster.max_requeues):
                sys.exit(-1)
            raise RuntimeError(f"run {spec.key} was stopped ({outcome.reason}) and cannot be requeued")
        if outcome.status == "FAILED":
            raise RuntimeError(f"run {spec.key} failed: {outcome.reason}")
        if outcome.status == "DIVERGED":  # a tune point's result: its LR is too high (the tuning reads it)
            return {"run_key": spec.key, "diverged": outcome.reason, "step": outcome.step}
        if spec.config.eval.after_train and _is_rank0():
            from study.jobs.eval import evaluate_run

            evaluate_run(spec)
        if spec.role == Role.branch and _is_rank0():  # its rung may now be complete: decide it (a racing experiment)
            from study.launch.racing import settle

            settle(spec.config.paths.runs, spec.config.experiment, spec.config.tracking.uri)
        return {"run_key": spec.key, "val_loss": outcome.val_loss, "step": outcome.step}


@dataclass
class PrepareJob(submitit.helpers.Checkpointable):
    """Tokenise the shards a group of runs reads (CPU only). Checkpointable: a requeued or preempted job resumes
    the tokenisation after its last finished chunk."""

    run_dir: str
    """A run of the group: its spec names the data config."""
    model_vocab: int
    """The smallest model.vocab_size of the group, checked against the tokenizer before tokenising."""

    def __call__(self) -> str:
        from study.jobs.prepare import DataGroup, prepare_group, shards_id

        spec = read_spec(self.run_dir)
        data = spec.config.data
        prepare_group(DataGroup(data, self.model_vocab, [spec], shards_id(data)), progress=True)
        return shards_id(data)


@dataclass
class ProfileJob(submitit.helpers.Checkpointable):
    """Measure the geometric work of a finished reference run (writes its profile.json)."""

    run_dir: str

    def __call__(self) -> str:
        from study.jobs.profile import profile_run

        return str(profile_run(read_spec(self.run_dir)))


def _branch_releaser(spec: RunSpec):
    """For a trunk on SLURM: releases its held branches at each branch start it writes (and, first, those whose
    start it wrote before a requeue); None otherwise."""
    if spec.role != Role.trunk or not os.environ.get("SLURM_JOB_ID") or not _is_rank0():
        return None
    from study.launch.branching import release_branches
    from study.train.checkpoint import at_step

    for step in sorted(spec.kept_steps):
        if at_step(spec.run_dir.path, step) is not None:
            release_branches(spec, step)
    return lambda step: release_branches(spec, step)


def _completed(spec: RunSpec) -> RunSpec:
    """A scheduled run's spec with its widths, from its reference's profile (done once, then read back)."""
    if spec.pending is None:
        return spec
    from study.plan.complete import complete_spec

    spec = complete_spec(spec)
    if _is_rank0():
        write_spec(spec)
    return spec
