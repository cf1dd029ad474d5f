"""One training run from its run spec: data, (FSDP) model, AdamW, periodic validation and checkpoints, exact
resume, MLflow.

    study train experiment=demo variant=hourglass seed=0      # one process
    study train experiment=demo variant=hourglass --nproc 2   # FSDP2 over gloo (CPU) or NCCL (GPU)
    python -m study.train -m hydra/launcher=submitit_slurm scale=tiny seed=0,1   # Hydra multirun

The spec says what to build (its matched model) and how to train it; nothing is re-planned here. Resume is exact:
the batch of step s is a pure function of (seed, s), the LR schedule a function of s, and the checkpoint holds
model, optimizer, RNG and the `TrainState`; a restarted run continues from its latest complete checkpoint and
recomputes bit-identical losses (fp32 on CPU). Tracking dedups the re-logged steps.
"""

from __future__ import annotations

import errno
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from study import schema
from study.config.recipe import batch_layout
from study.config.run import RunConfig
from study.config.spec import RunSpec, held_spec, write_spec
from study.errors import StudyError
from study.train import checkpoint
from study.train.distributed import Dist, all_reduce_max, all_reduce_mean, barrier, setup
from study.train.faults import FaultHooks
from study.train.lease import acquire
from study.train.progress import Progress
from study.train.signals import StopRequest
from study.train.state import TrainState
from study.train.tracking import log_job_output, open_tracker
from study.train.step import cross_entropy, train_step

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: the run saved its state and wants to be started again


class Diverged(RuntimeError):
    """The loss became NaN or infinite."""


@dataclass
class Outcome:
    status: str
    """FINISHED, FAILED or PREEMPTED."""
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
    """(micro batch, accumulation steps) per rank that split the recipe's global batch over this job's ranks."""
    r = spec.planned
    if d.world_size == r.world_size:
        return r.micro_batch, r.grad_accum
    return batch_layout(r.global_batch, spec.config.train.micro_batch, d.world_size, "world size")


def validate(model, data, cfg: RunConfig, d: Dist, micro: int) -> float:
    import torch

    from study.data import val_batches

    total, n = torch.zeros((), dtype=torch.float64, device=d.device), 0
    model.eval()
    with torch.no_grad():
        for x, y in val_batches(data.val, data.seq_len, micro * d.world_size, cfg.train.val_batches, d.rank, d.world_size):
            logits = model(x.to(d.device))
            total += cross_entropy(logits, y.to(d.device), 0.0).double()
            n += 1
    model.train()
    return float(all_reduce_mean(total / max(n, 1), d).item())


def wrap_fsdp(model, cfg: RunConfig, d: Dist):
    """FSDP2: shard every block, then the root (embedding, final norm, head); bf16 compute on CUDA only."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if use_bf16(cfg, d) else None
    kwargs = {"mp_policy": mp} if mp else {}
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def use_compile(cfg: RunConfig, d: Dist) -> bool:
    c = cfg.train.compile
    return d.device.startswith("cuda") if c is None else bool(c)


def use_bf16(cfg: RunConfig, d: Dist) -> bool:
    p = cfg.train.precision
    return p == "bf16" or (p == "auto" and d.device.startswith("cuda"))


def compute_dtype(cfg: RunConfig, d: Dist) -> str:
    """What the run's forward passes compute in: bf16 under FSDP's policy or CUDA autocast (the only autocast the
    step enables), else fp32."""
    bf16 = use_bf16(cfg, d) and (d.world_size > 1 or d.device.startswith("cuda"))
    return "bfloat16" if bf16 else "float32"


def train(spec: RunSpec, restart: bool = False) -> Outcome:
    """Train (or resume) the run the spec describes, holding its run directory's lease; with `restart`, from step 0,
    its earlier training set aside (study.train.restart). Collective when world size > 1."""
    if spec.awaits_tuning:
        raise StudyError("tune", f"run {spec.name} ({spec.key}) trains at the LR its variant's tuning chooses, which "
                         f"has not decided yet ({spec.pending})", f"launch the experiment (study launch "
                         f"{spec.config.experiment}): it trains the tune runs first, then this one")
    d = setup(spec.config.train.device)
    rdir = spec.run_dir.path
    if d.is_main:
        _writable(rdir)
    lease = acquire(rdir, spec.key, d)
    try:
        if d.is_main:
            _claim(spec)
            from study.train import restart as restarts

            interrupted = restarts.staged(spec)
            if restart or interrupted is not None:
                restarts.restart(spec, interrupted)
        barrier(d)  # every rank looks for checkpoints after a restart has set them aside
        return _train(spec, d)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise _no_space(spec, err) from None
    finally:
        if lease is not None:
            lease.release()


def _no_space(spec: RunSpec, err: OSError) -> StudyError:
    import shutil

    rdir = spec.run_dir.path
    last = checkpoint.latest(rdir)
    return StudyError("paths.runs", f"no space left on {rdir} (writing {err.filename or 'to it'}; "
                      f"{shutil.disk_usage(rdir).free >> 20} MiB free on its file system)",
                      "free space on that file system (other runs' old checkpoints, or a lower train.keep_last), or "
                      "move the runs folder to one with room and point paths.runs there; started again, the run "
                      f"resumes from {last.name if last else 'step 0'}")


def _claim(spec: RunSpec) -> None:
    """The run directory holds this run's spec, never another's."""
    held_spec(spec)
    write_spec(spec)  # the run directory always holds the spec that trained it


def _keep_tokenizer(source: Path, copy: Path, eos_id: int) -> None:
    """The run directory keeps the tokenizer it was trained with, and the token that ended its documents in
    tokenizer_config.json beside it (as transformers declares one), so evaluation and export never need the data
    or its source directory again: a transformers directory's declared EOS is not among the tokenizer's own."""
    import json

    from study.data.tokenizer import TOKENIZER_CONFIG, load_tokenizer

    config = json.dumps({"eos_token": load_tokenizer(source).id_to_token(eos_id)}).encode()
    for path, content in ((copy, source.read_bytes()), (copy.with_name(TOKENIZER_CONFIG), config)):
        if path.is_file() and path.read_bytes() == content:
            continue
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_bytes(content)
        os.replace(tmp, path)


def _train(spec: RunSpec, d: Dist) -> Outcome:
    import torch

    cfg, key, model_cfg, recipe = spec.config, spec.key, spec.model, spec.planned
    rdir = spec.run_dir.path
    micro, _ = layout(spec, d)
    max_steps = recipe.max_steps

    from study.config.data import validate_data
    from study.data import prepare_data

    validate_data(cfg.data)
    data = prepare_data(cfg.data, model_vocab=model_cfg.vocab_size)
    from study.data.batches import check_val_split

    check_val_split(data.val, data.seq_len, micro * d.world_size, from_files=bool(cfg.data.val_tokens))
    from study.train.data_record import check_data

    check_data(spec, data, write=d.rank == 0)  # before the tokenizer copy: a start on other data leaves it as it is
    if d.rank == 0:
        _keep_tokenizer(data.tokenizer_path, spec.run_dir.tokenizer, data.eos_id)

    from study.models.transformer import build_model
    from study.train.optim import build_optimizer, build_scheduler

    if not d.device.startswith("cuda"):
        _keep_freed_memory()
    torch.manual_seed(cfg.weights_seed)
    model = build_model(model_cfg, d.device, seed=cfg.weights_seed)
    if d.world_size > 1:
        model = wrap_fsdp(model, cfg, d)
    if cfg.train.activation_checkpointing:
        _checkpoint_blocks(model)
    step_model = torch.compile(model) if use_compile(cfg, d) else model
    optimizer = build_optimizer(model, cfg.train, recipe.lr)

    shape = model_hash(model_cfg)
    state = (checkpoint.load_latest(rdir, model, optimizer, d, key, shape)
             or TrainState(max_steps=max_steps, run_key=key))
    state.run_key, state.model_hash, state.compute_dtype = key, shape, compute_dtype(cfg, d)
    start = state.step
    scheduler = build_scheduler(optimizer, recipe, cfg.train, start)

    tracker = open_tracker(spec, d, data, start)
    stop = StopRequest.install()
    stream = batch_stream(spec, data, d, start)
    progress = Progress(d, start, max_steps, spec.name, spec.run_dir.progress)
    losses: dict[int, float] = {}
    faults = FaultHooks(cfg.faults)
    autocast_bf16 = use_bf16(cfg, d) and d.world_size == 1  # FSDP's policy casts sharded runs
    tokens_per_step = recipe.global_batch * data.seq_len
    t_last, steps_since = time.perf_counter(), 0
    outcome = None
    try:
        for step in range(start + 1, max_steps + 1):
            batches = next(stream)
            loss_sum, grad_norm = train_step(model, step_model, optimizer, scheduler, batches, d.device,
                                             cfg.train.z_loss, cfg.train.grad_clip, autocast_bf16,
                                             sharded=d.world_size > 1)
            steps_since += 1
            if step % cfg.train.log_interval == 0 or step == max_steps:
                mean_loss = faults.loss(step, float(all_reduce_mean(loss_sum / len(batches), d).item()))
                if not math.isfinite(mean_loss):
                    raise Diverged(f"training loss is {mean_loss} at step {step}")
                losses[step] = mean_loss
                now = time.perf_counter()
                tps = tokens_per_step * steps_since / (now - t_last)
                t_last, steps_since = now, 0
                metrics = {schema.TRAIN_LOSS: mean_loss, schema.TRAIN_LR: scheduler.get_last_lr()[0],
                           schema.TRAIN_GRAD_NORM: float(grad_norm.item()), schema.TRAIN_TOKENS_PER_S: tps}
                if d.device.startswith("cuda"):
                    metrics[schema.TRAIN_MFU] = spec.flops_per_token * tps / (cfg.train.gpu_peak_tflops * 1e12
                                                                             * d.world_size)
                tracker.log_metrics(metrics, step)
                progress.update(step, mean_loss, tps)
            if step % cfg.train.val_interval == 0 or step == max_steps:
                state.val_loss = validate(step_model, data, cfg, d, micro)
                if not math.isfinite(state.val_loss):
                    raise Diverged(f"validation loss is {state.val_loss} at step {step}")
                tracker.log_metrics({schema.VAL_LOSS: state.val_loss,
                                     schema.VAL_PPL: math.exp(min(state.val_loss, 50.0))}, step)
            faults.after_step(step, stop)
            state.step = step
            stopping = all_reduce_max(float(stop.requested), d) > 0
            if step % cfg.train.ckpt_interval == 0 or step == max_steps or stopping:
                # points up to the checkpoint are durable in the run directory before it counts (a resumed run never
                # recomputes them); the flush only makes them land in MLflow sooner
                tracker.sync()
                tracker.flush(timeout_s=cfg.tracking.checkpoint_flush_s)
                checkpoint.save(rdir, model, optimizer, state, d, cfg.train.keep_last)
            if stopping and step < max_steps:
                outcome = Outcome("PREEMPTED", step, None, losses, f"stopped by {stop.signal_name} at step {step}")
                break
        else:
            outcome = Outcome("FINISHED", max_steps, state.val_loss, losses)
    except Diverged as err:
        outcome = Outcome("FAILED", step, None, losses, str(err))
    except BaseException as err:
        log_job_output(tracker, spec)
        tracker.close("FAILED", f"{type(err).__name__}: {err}")
        raise
    finally:
        stream.close()
        progress.close()
        stop.uninstall()
    _finish(outcome, tracker, spec, d)
    return outcome


def _finish(outcome: Outcome, tracker, spec: RunSpec, d: Dist) -> None:
    if outcome.status == "PREEMPTED":
        tracker.log_metrics({schema.TRAIN_PREEMPTED_AT: outcome.step}, outcome.step)
        tracker.close("KILLED", outcome.reason)
        return
    if outcome.status == "FINISHED" and d.is_main:
        spec.run_dir.result.write_text(json.dumps({"val_loss": outcome.val_loss, "step": outcome.step,
                                                   "run_key": spec.key}))
    log_job_output(tracker, spec)
    tracker.close(outcome.status, outcome.reason)
    if outcome.status == "FINISHED":
        from study.track.groups import refresh_quietly

        tracker.record("parent summary", refresh_quietly)


def model_hash(model_cfg) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(asdict(model_cfg), sort_keys=True).encode()).hexdigest()[:12]


def _keep_freed_memory() -> None:
    """glibc returns large freed blocks to the OS and faults them back in every step (about 10x the page faults);
    keeping them made the CPU step 7-15 % faster (benchmarks `malloc` figure). Same as MALLOC_MMAP_THRESHOLD_=32MiB,
    MALLOC_TRIM_THRESHOLD_=1GiB, set from inside the process."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return
    libc = ctypes.CDLL(name)
    if hasattr(libc, "mallopt"):
        m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
        libc.mallopt(m_mmap_threshold, 32 << 20)
        libc.mallopt(m_trim_threshold, 1 << 30)


def _writable(rdir: Path) -> None:
    """Fail before anything is tracked when the run directory cannot hold checkpoints."""
    import errno
    import os

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


def _checkpoint_blocks(model) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from study.models.transformer import Block

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
