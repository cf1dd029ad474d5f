"""AdamW parameter groups and the learning-rate schedule (the run spec's recipe says all of it: peak, warm-up, decay
shape and fraction, length and end; the config's train.* schedule fields are read once, by the planner)."""

from __future__ import annotations

import math

from study.config.recipe import Recipe, decay_start
from study.config.training import TrainConfig


QK_NORMS = (".q_norm.weight", ".k_norm.weight")


def decays(name: str, ndim: int, qk_norm_decay: bool, embedding_decay: bool = False) -> bool:
    """Matrices decay; the embedding only when the recipe says so (Megatron decays it, OLMo-2 and LLaMA recipes do
    not); of the norm gains only the QK-norm's, when the recipe says so (Megatron's apply_wd_to_qk_layernorm)."""
    if name.startswith("embed."):
        return embedding_decay
    return ndim >= 2 or (qk_norm_decay and name.endswith(QK_NORMS))


def param_groups(model, t: TrainConfig) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if decays(name, p.ndim, t.qk_norm_decay, t.embedding_decay) else no_decay).append(p)
    return [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model, t: TrainConfig, lr: float):
    import torch

    # fused kernels on CUDA and CPU alike: on CPU the optimizer step fell from 5.7 to 1.6 ms for the tiny model
    # (foreach was no faster than the per-tensor loop there; benchmarks/RESULTS.md)
    return torch.optim.AdamW(param_groups(model, t), lr=lr, betas=(t.beta1, t.beta2), eps=t.eps,
                             fused=True)


def lr_factor(step: int, recipe: Recipe) -> float:
    """Multiplier of the peak LR at `step` (0-based, applied to the update of step+1); it ends at final_lr / lr."""
    max_steps, warmup = recipe.max_steps, recipe.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    floor = recipe.final_lr / recipe.lr
    if recipe.lr_schedule == "cosine":
        progress = (step - warmup) / max(1, max_steps - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    if recipe.lr_schedule == "wsd":
        start = decay_start(max_steps, recipe.decay_fraction)
        if step < start:
            return 1.0
        return 1.0 - (1 - floor) * (step - start) / max(1, max_steps - start)
    raise ValueError(f"recipe.lr_schedule {recipe.lr_schedule!r} passed the config check")  # a bug, not bad input


def build_scheduler(optimizer, recipe: Recipe, start_step: int):
    import torch

    for group in optimizer.param_groups:
        # a restored optimizer carries the last step's decayed lr; the schedule must scale the peak
        group["initial_lr"] = recipe.lr
    # The schedule is a pure function of the step, so a resumed run restarts it at its step.
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, recipe), last_epoch=start_step - 1)
