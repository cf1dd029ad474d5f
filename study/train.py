"""One training run: data, (FSDP) model, AdamW, periodic validation and checkpoints, exact resume, MLflow.

    study train experiment=demo variant=hourglass seed=0      # one process
    study train experiment=demo variant=hourglass --nproc 2   # FSDP2 over gloo (CPU) or NCCL (GPU)
    python -m study.train -m hydra/launcher=submitit_slurm scale=tiny seed=0,1   # Hydra multirun

Resume is exact: the batch of step s is a pure function of (seed, s), the LR schedule a function of s, and the
checkpoint holds model, optimizer and RNG; a restarted run continues from its latest complete checkpoint and
recomputes bit-identical losses (fp32 on CPU). Tracking dedups the re-logged steps.
"""

from __future__ import annotations

import json
import math
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from study import checkpoint
from study.config import LAUNCH_ONLY, RunConfig, run_key, run_name
from study.distributed import Dist, all_reduce_max, all_reduce_mean, setup
from study.errors import StudyError
from study.plan import resolve_model, run_dir
from study.runs import StopRequest, run_tags

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


def batch_layout(cfg: RunConfig, world: int) -> tuple[int, int]:
    """(micro_batch, grad_accum) per rank; a fixed global batch keeps paired runs' data identical at any world size."""
    t = cfg.train
    if t.micro_batch <= 0 or t.grad_accum <= 0:
        raise StudyError("train.micro_batch", "micro_batch and grad_accum must be positive", "use values >= 1")
    if not t.global_batch:
        return t.micro_batch, t.grad_accum
    per_rank, rem = divmod(t.global_batch, world)
    if rem or per_rank % t.micro_batch:
        raise StudyError("train.global_batch", f"{t.global_batch} sequences do not split into {world} ranks of "
                         f"micro batches of {t.micro_batch}", "choose global_batch = micro_batch x accum x world size")
    return t.micro_batch, per_rank // t.micro_batch


def batch_stream(cfg: RunConfig, data, d: Dist, start: int):
    """Batches depend on the seed and the step only, never on the architecture: paired runs see the same data."""
    from study.data import BatchStream

    micro, accum = batch_layout(cfg, d.world_size)
    return BatchStream(data.train, data.seq_len, cfg.seed, micro, accum, d.rank, d.world_size, start, d.device)


def train_steps(cfg: RunConfig, counted: int, seqs_per_step: int) -> int:
    if cfg.train.max_steps > 0:
        return cfg.train.max_steps
    return max(1, math.ceil(cfg.train.tokens_per_param * counted / (seqs_per_step * cfg.data.seq_len)))


def cross_entropy(logits, targets, z_loss: float):
    import torch.nn.functional as F

    flat = logits.reshape(-1, logits.shape[-1]).float()
    loss = F.cross_entropy(flat, targets.reshape(-1))
    if z_loss:
        # OLMo-2: z = coef * mean(logsumexp(logits)^2) keeps the softmax normaliser near 1
        loss = loss + z_loss * flat.logsumexp(-1).pow(2).mean()
    return loss


def evaluate(model, data, cfg: RunConfig, d: Dist, micro: int) -> float:
    import torch

    from study.data import val_batches

    total, n = torch.zeros((), dtype=torch.float64, device=d.device), 0
    model.eval()
    with torch.no_grad():
        for x, y in val_batches(data.val, data.seq_len, micro * d.world_size, cfg.train.eval_batches, d.rank, d.world_size):
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


def use_bf16(cfg: RunConfig, d: Dist) -> bool:
    p = cfg.train.precision
    if p not in ("auto", "fp32", "bf16"):
        raise StudyError("train.precision", f"unknown precision {p!r}", "use auto, fp32 or bf16")
    return p == "bf16" or (p == "auto" and d.device.startswith("cuda"))


def train(cfg: RunConfig) -> Outcome:
    """Train (or resume) the run `cfg` describes. Collective when world size > 1."""
    import torch

    from study.data import validate_data
    from study.validate import validate_run

    validate_run(cfg)
    validate_data(cfg.data)
    key = run_key(cfg)
    matched = resolve_model(cfg)
    d = setup(cfg.train.device)
    rdir = run_dir(cfg, key)
    if d.is_main:
        _writable(rdir)
    micro, accum = batch_layout(cfg, d.world_size)
    seqs_per_step = micro * accum * d.world_size
    max_steps = train_steps(cfg, matched.params.counted, seqs_per_step)
    lr = cfg.train.lr or _scaled_lr(matched.params.counted)
    warmup = cfg.train.warmup_steps or max(1, int(0.02 * max_steps))

    from study.data import prepare_data

    data = prepare_data(cfg.data)
    if data.vocab_size > matched.model.vocab_size:
        raise StudyError("model.vocab_size", f"{matched.model.vocab_size} rows cannot embed the tokenizer's "
                         f"{data.vocab_size} ids", f"set model.vocab_size >= {data.vocab_size}")
    if data.seq_len > matched.model.max_seq_len:
        raise StudyError("data.seq_len", f"{data.seq_len} exceeds model.max_seq_len {matched.model.max_seq_len}",
                         "raise model.max_seq_len or lower data.seq_len")

    from study.models.transformer import build_model
    from study.optim import build_optimizer, build_scheduler

    if not d.device.startswith("cuda"):
        _keep_freed_memory()
    torch.manual_seed(cfg.seed)
    model = build_model(matched.model, d.device, seed=cfg.seed)
    if d.world_size > 1:
        model = wrap_fsdp(model, cfg, d)
    if cfg.train.activation_checkpointing:
        _checkpoint_blocks(model)
    step_model = torch.compile(model) if cfg.train.compile else model
    optimizer = build_optimizer(model, cfg.train, lr)

    start, state = 0, {}
    found = checkpoint.latest(rdir)
    if found is not None:
        state = checkpoint.load(found, model, optimizer, d)
        start = state["step"]
    scheduler = build_scheduler(optimizer, lr, max_steps, warmup, cfg.train, start)

    tracker = _open_tracker(cfg, key, matched, d, rdir, max_steps, lr)
    stop = StopRequest.install()
    stream = batch_stream(cfg, data, d, start)
    progress = _progress(d, start, max_steps, run_name(cfg))
    losses: dict[int, float] = {}
    val_loss = state.get("val_loss")
    tokens_per_step = seqs_per_step * data.seq_len
    flops = _flops(matched, cfg)
    t_last, steps_since = time.perf_counter(), 0
    outcome = None
    try:
        for step in range(start + 1, max_steps + 1):
            batches = next(stream)
            loss_sum = torch.zeros((), device=d.device)
            for i, (x, y) in enumerate(batches):
                if d.world_size > 1:  # reduce-scatter gradients once per step, on the last micro batch
                    model.set_requires_gradient_sync(i == len(batches) - 1)
                with torch.autocast("cuda", torch.bfloat16, enabled=use_bf16(cfg, d) and d.world_size == 1):
                    loss = cross_entropy(step_model(x.to(d.device, non_blocking=True)), y.to(d.device), cfg.train.z_loss)
                (loss / len(batches)).backward()
                loss_sum += loss.detach()
            grad_norm = _clip(model, cfg.train.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            steps_since += 1
            if step % cfg.train.log_interval == 0 or step == max_steps:
                mean_loss = float(all_reduce_mean(loss_sum / len(batches), d).item())
                if step == cfg.faults.nan_at_step:
                    mean_loss = float("nan")
                if not math.isfinite(mean_loss):
                    raise Diverged(f"training loss is {mean_loss} at step {step}")
                losses[step] = mean_loss
                now = time.perf_counter()
                tps = tokens_per_step * steps_since / (now - t_last)
                t_last, steps_since = now, 0
                metrics = {"train/loss": mean_loss, "train/lr": scheduler.get_last_lr()[0],
                           "train/grad_norm": float(grad_norm.item()), "train/tokens_per_s": tps}
                if d.device.startswith("cuda"):
                    metrics["train/mfu"] = flops * tps / (cfg.train.gpu_peak_tflops * 1e12 * d.world_size)
                tracker.log_metrics(metrics, step)
                progress.update(step, mean_loss, tps)
            if cfg.faults.sleep_per_step:
                time.sleep(cfg.faults.sleep_per_step)
            if step % cfg.train.eval_interval == 0 or step == max_steps:
                val_loss = evaluate(step_model, data, cfg, d, micro)
                tracker.log_metrics({"val/loss": val_loss, "val/ppl": math.exp(min(val_loss, 50.0))}, step)
            if step == cfg.faults.stop_at_step:
                stop.signal_name = "SIGUSR2 (injected)"
            stopping = all_reduce_max(float(stop.requested), d) > 0
            if step % cfg.train.ckpt_interval == 0 or step == max_steps or stopping:
                # points up to the checkpoint must land before it counts: a resumed run never recomputes them
                tracker.flush(timeout_s=cfg.tracking.checkpoint_flush_s)
                checkpoint.save(rdir, step, model, optimizer, {"val_loss": val_loss, "max_steps": max_steps},
                                d, cfg.train.keep_last)
            if stopping and step < max_steps:
                outcome = Outcome("PREEMPTED", step, None, losses, f"stopped by {stop.signal_name} at step {step}")
                break
        else:
            outcome = Outcome("FINISHED", max_steps, val_loss, losses)
    except Diverged as err:
        outcome = Outcome("FAILED", step, None, losses, str(err))
    except BaseException as err:
        tracker.close("FAILED", f"{type(err).__name__}: {err}")
        raise
    finally:
        stream.close()
        progress.close()
        stop.uninstall()
    _finish(outcome, tracker, cfg, rdir, d)
    return outcome


def _finish(outcome: Outcome, tracker, cfg: RunConfig, rdir: Path, d: Dist) -> None:
    if outcome.status == "PREEMPTED":
        tracker.log_metrics({"train/preempted_at": outcome.step}, outcome.step)
        tracker.close("KILLED", outcome.reason)
        return
    if outcome.status == "FINISHED" and d.is_main:
        (rdir / "result.json").write_text(json.dumps({"val_loss": outcome.val_loss, "step": outcome.step}))
    tracker.close(outcome.status, outcome.reason)


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
        probe = rdir / ".write-probe"
        probe.write_bytes(b"x" * 4096)
        probe.unlink()
    except OSError as err:
        fix = ("free space on that file system or point paths.runs elsewhere" if err.errno == errno.ENOSPC
               else "point paths.runs at a writable directory (shared between nodes on a cluster)")
        raise StudyError("paths.runs", f"cannot write the run directory {rdir} ({os.strerror(err.errno or 0)})",
                         fix) from None


def _scaled_lr(counted: int) -> float:
    from study.optim import scaled_lr

    return scaled_lr(counted)


def _flops(matched, cfg: RunConfig) -> float:
    from study.budget import flops_per_token

    return flops_per_token(matched.model, cfg.data.seq_len)


def _clip(model, max_norm: float):
    """Clip the global gradient norm; returns it as a tensor, read only at log steps (no device sync per step)."""
    import torch

    if max_norm <= 0:
        max_norm = float("inf")  # measure the norm for logging, clip nothing
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _checkpoint_blocks(model) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from study.models.transformer import Block

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))


def _open_tracker(cfg: RunConfig, key: str, matched, d: Dist, rdir: Path, max_steps: int, lr: float):
    from study.tracking import Tracker

    params = {k: v for k, v in asdict(cfg).items() if k not in LAUNCH_ONLY}
    params["resolved"] = {"n_layers": matched.model.n_layers, "d_model": matched.model.d_model,
                          "n_heads": matched.model.n_heads, "ffn_widths": matched.model.ffn.widths,
                          "max_steps": max_steps, "lr": lr, "world_size": d.world_size}
    params["params"] = matched.params.as_dict()
    tracker = Tracker.open(key, cfg.experiment, run_name(cfg), run_tags(cfg, key), params, rank=d.rank, cfg=cfg.tracking)
    if d.is_main:
        import yaml

        tracker.log_dict(asdict(cfg), "config.yaml")
        tracker.log_dict({"run_key": key, "budget": matched.budget, "mismatch": matched.mismatch,
                          "params": matched.params.as_dict(), "ffn_widths": matched.model.ffn.widths},
                         "param_table.json")
        (rdir / "config.yaml").write_text(yaml.safe_dump(asdict(cfg), sort_keys=False))
    return tracker


class _progress:
    """One progress line on rank 0: step, loss, tokens/s, ETA."""

    def __init__(self, d: Dist, start: int, total: int, name: str):
        self.bar = None
        if d.is_main:
            import sys

            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc=name, unit="step", dynamic_ncols=True,
                            mininterval=0.5 if sys.stderr.isatty() else 10.0)
        self.last = start

    def update(self, step: int, loss: float, tps: float) -> None:
        if self.bar is not None:
            self.bar.update(step - self.last)
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tps:,.0f}", refresh=False)
        self.last = step

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main_hydra() -> None:
    """`python -m study.train [-m] key=value ...`: Hydra (and its launcher plugins) on the sweeps/ tree."""
    import hydra
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from study.config import RunConfig, typed_defaults, sweeps_dir

    ConfigStore.instance().store(name="run_schema", node=RunConfig)

    @hydra.main(version_base=None, config_path=str(sweeps_dir()), config_name="train")
    def _run(node) -> float | None:
        from dataclasses import replace

        from hydra.core.hydra_config import HydraConfig

        cfg = OmegaConf.to_object(OmegaConf.merge(typed_defaults(), node))
        # `experiment` is the group of experiment files here, so ad-hoc grids are named by hydra.job.name
        job = HydraConfig.get().job.name
        cfg = replace(cfg, experiment="adhoc" if job == "train" else job)
        outcome = train(cfg)
        return outcome.val_loss

    _run()


if __name__ == "__main__":
    main_hydra()
