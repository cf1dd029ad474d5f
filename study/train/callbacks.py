"""The training loop's seams: the hooks it calls at fixed points of every step, and the callbacks that log, validate
and checkpoint there. After the optimizer step the loop calls each hook on every callback, in list order:

    on_step(step, out)           Metrics (log steps: the loss agreed across ranks, LR, grad norm, tokens/s, MFU on
                                 CUDA; then on_log to every callback, e.g. Progress), then Validation (val steps: the
                                 validation loss and perplexity; then on_validation)
    before_stop(step, stop)      the last moment a stop can be asked for and still act at this step (FaultHooks)
    on_step_end(step, stopping)  the state holds this step and the ranks agreed on `stopping`: Checkpointing
                                 (before_checkpoint to every callback, the tracker synced and flushed, the save)
    close()                      once, when the loop ends, however it ends

So the tracker sees the training loss, then the validation loss, then the checkpoint, and a stopped run checkpoints
its step first. To add a callback, subclass `Callback` and place it in `loop._train`'s list. Raising `Diverged`
fails the run with its message as the reason (a non-finite loss does); any other exception fails it and propagates.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from study import schema
from study.config.faults import FaultsConfig
from study.config.spec import RunSpec
from study.files import replace_file
from study.track.tracker import RunTracker
from study.train import checkpoint
from study.train.distributed import Dist, all_reduce_mean
from study.train.signals import StopRequest
from study.train.state import TrainState


class Diverged(RuntimeError):
    """The loss became NaN or infinite."""


@dataclass
class StepOutput:
    """What one optimizer step returns, as tensors still on the device (read back only where a callback needs it)."""

    loss_sum: object
    """The micro-batches' losses, summed."""
    micro_batches: int
    grad_norm: object
    """The global gradient norm before clipping."""


class Callback:
    """Every hook does nothing; a callback overrides the ones it needs (the module docstring gives their order)."""

    def on_step(self, step: int, out: StepOutput) -> None:
        """After the optimizer step of `step`."""

    def on_log(self, step: int, loss: float, tokens_per_s: float) -> None:
        """The training loss of `step` (mean over ranks) has been logged."""

    def on_validation(self, step: int, loss: float) -> None:
        """The validation loss at `step` has been logged."""

    def before_stop(self, step: int, stop: StopRequest) -> None:
        """Before the ranks agree on whether to stop after `step`."""

    def on_step_end(self, step: int, stopping: bool) -> None:
        """`step` is the state's; `stopping` is what every rank agreed."""

    def before_checkpoint(self, step: int) -> None:
        """The checkpoint of `step` is about to be saved: what is logged here is durable before it counts."""

    def close(self) -> None:
        """The loop has ended (finished, stopped, diverged or failed)."""


@dataclass
class Run:
    """What the callbacks share, the callbacks themselves included (to tell the others what happened)."""

    spec: RunSpec
    d: Dist
    tracker: RunTracker
    state: TrainState
    callbacks: list[Callback] = field(default_factory=list)

    def call(self, hook: str, *args) -> None:
        """`hook` called on every callback, in list order."""
        for callback in self.callbacks:
            getattr(callback, hook)(*args)

    def due(self, step: int, interval: int) -> bool:
        """Every `interval` steps, and always at the last one (a trunk's: its last branch start) and at a trunk's
        branch starts (its branches start from those checkpoints)."""
        return step % interval == 0 or step == self.spec.last_step or step in self.spec.kept_steps


class Metrics(Callback):
    """Training loss, LR, grad norm, tokens/s (MFU on CUDA) to the tracker at log steps; losses kept for the outcome."""

    def __init__(self, run: Run, scheduler, tokens_per_step: int, inject):
        self.run, self.scheduler, self.tokens_per_step = run, scheduler, tokens_per_step
        self.inject = inject  # the fault suite's NaN (FaultHooks.loss)
        self.losses: dict[int, float] = {}
        self.t_last, self.steps_since = time.perf_counter(), 0

    def on_step(self, step, out):
        run, train = self.run, self.run.spec.config.train
        self.steps_since += 1
        if not run.due(step, train.log_interval):
            return
        mean_loss = self.inject(step, float(all_reduce_mean(out.loss_sum / out.micro_batches, run.d).item()))
        if not math.isfinite(mean_loss):
            raise Diverged(f"training loss is {mean_loss} at step {step}")
        self.losses[step] = mean_loss
        now = time.perf_counter()
        tps = self.tokens_per_step * self.steps_since / (now - self.t_last)
        self.t_last, self.steps_since = now, 0
        metrics = {schema.TRAIN_LOSS: mean_loss, schema.TRAIN_LR: self.scheduler.get_last_lr()[0],
                   schema.TRAIN_GRAD_NORM: float(out.grad_norm.item()), schema.TRAIN_TOKENS_PER_S: tps}
        if run.d.device.startswith("cuda"):
            metrics[schema.TRAIN_MFU] = run.spec.flops_per_token * tps / (train.gpu_peak_tflops * 1e12
                                                                          * run.d.world_size)
        run.tracker.log_metrics(metrics, step)
        run.call("on_log", step, mean_loss, tps)


class Progress(Callback):
    """Training progress for people: one tqdm line on rank 0 (step, loss, tokens/s, ETA), and the same figures in the
    run directory's progress.json for whoever watches several runs at once (`study launch` on this machine, `study
    demo`). It moves on whenever the training loss is logged."""

    def __init__(self, d: Dist, start: int, total: int, name: str, path: Path | None = None):
        from tqdm import tqdm

        self.path = path if d.is_main else None
        self.start, self.total, self.t0, self.last = start, total, time.monotonic(), start
        self.bar = tqdm(total=total, initial=start, desc=name, unit="step", dynamic_ncols=True, disable=not d.is_main,
                        mininterval=0.5 if sys.stderr.isatty() else 10.0)

    def on_log(self, step: int, loss: float, tps: float) -> None:
        self.bar.update(step - self.last)
        self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tps:,.0f}", refresh=False)
        self.last = step
        if self.path is not None:
            rate = (step - self.start) / max(time.monotonic() - self.t0, 1e-9)
            # replaced whole (write, then rename): a reader never sees half of it
            replace_file(self.path, json.dumps({"step": step, "max_steps": self.total, "loss": loss,
                                                "tokens_per_s": tps, "time": time.time(),
                                                "eta_s": (self.total - step) / rate if rate > 0 else None}))

    def close(self) -> None:
        self.bar.close()


class Validation(Callback):
    """The validation loss and perplexity at val steps; the state keeps the latest (a finished run's result)."""

    def __init__(self, run: Run, model, data, micro: int):
        self.run, self.model, self.data, self.micro = run, model, data, micro

    def on_step(self, step, out):
        run = self.run
        if not run.due(step, run.spec.config.train.val_interval):
            return
        windows = run.spec.planned.validation_windows(run.spec.config.train.val_batches)
        run.state.val_loss = loss = validate(self.model, self.data, windows, run.d, self.micro)
        if not math.isfinite(loss):
            raise Diverged(f"validation loss is {loss} at step {step}")
        run.tracker.log_metrics({schema.VAL_LOSS: loss, schema.VAL_PPL: math.exp(min(loss, 50.0))}, step)
        run.call("on_validation", step, loss)


class FaultHooks(Callback):
    """Fault injection for the fault suite (`faults.*` settings), kept out of the training step: a callback and the
    training-loss filter of Metrics; they do nothing unless a test set them."""

    def __init__(self, cfg: FaultsConfig):
        self.cfg = cfg

    def loss(self, step: int, value: float) -> float:
        """The logged loss, made NaN at `nan_at_step`."""
        return float("nan") if step == self.cfg.nan_at_step else value

    def before_stop(self, step: int, stop: StopRequest) -> None:
        """Sleep (so signals land mid-run) and, at `stop_at_step`, behave as if SIGUSR2 arrived."""
        if self.cfg.sleep_per_step:
            time.sleep(self.cfg.sleep_per_step)
        if step == self.cfg.stop_at_step:
            stop.signal_name = "SIGUSR2 (injected)"


class Checkpointing(Callback):
    """A checkpoint at checkpoint steps, the last step, and the step a run stops at."""

    def __init__(self, run: Run, model, optimizer, at_branch_start=None):
        self.run, self.model, self.optimizer = run, model, optimizer
        self.at_branch_start = at_branch_start  # called on rank 0 once a trunk's branch-start checkpoint is complete

    def on_step_end(self, step, stopping):
        run, cfg = self.run, self.run.spec.config
        if not (stopping or run.due(step, cfg.train.ckpt_interval)):
            return
        run.call("before_checkpoint", step)
        # points up to the checkpoint are durable in the run directory before it counts (a resumed run never
        # recomputes them); the flush only makes them land in MLflow sooner
        run.tracker.sync()
        run.tracker.flush(timeout_s=cfg.tracking.checkpoint_flush_s)
        checkpoint.save(run.spec.run_dir.path, self.model, self.optimizer, run.state, run.d, cfg.train.keep_last,
                        keep=run.spec.kept_steps)
        if self.at_branch_start is not None and run.d.is_main and step in run.spec.kept_steps:
            self.at_branch_start(step)


def validate(model, data, windows: int, d: Dist, micro: int) -> float:
    """The mean loss per token over the first `windows` validation windows, each rank scoring its share `micro` at a
    time: the same windows, so the same value up to rounding, on every world size and micro batch."""
    import torch
    import torch.nn.functional as F

    from study.data.batches import val_windows

    sums = torch.zeros(2, dtype=torch.float64, device=d.device)  # loss summed over windows, windows
    model.eval()
    with torch.no_grad():
        for x, y, real in val_windows(data.val, data.seq_len, windows, micro, d.rank, d.world_size):
            logits = model(x.to(d.device)).float()
            per_token = F.cross_entropy(logits.flatten(0, 1), y.to(d.device).flatten(), reduction="none")
            sums[0] += per_token.view(y.shape).mean(dim=1)[:real].double().sum()
            sums[1] += real
    model.train()
    total, n = all_reduce_mean(sums, d).tolist()  # means over ranks: their ratio is the ratio of the sums
    return total / n if n else math.nan  # the split is checked to hold windows before training starts
