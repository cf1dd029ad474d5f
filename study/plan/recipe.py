"""The training recipe a run spec carries, resolved once per run from its config and its scale's budget.

Steps and the peak LR come from the budget (the scale's reference count), so every arm of a comparison trains the same
tokens at the same LR schedule whatever its own count; `study plan` prints what the job will read.
"""

from __future__ import annotations

import math
from dataclasses import replace

from study.config.model import ModelConfig
from study.config.recipe import Recipe, batch_layout
from study.config.run import RunConfig


def scaled_lr(n_params: int) -> float:
    """OLMo-core model ladder: lr = 0.0047 * (N / 108e6) ** (-1/3), N the non-embedding parameter count."""
    return 0.0047 * (n_params / 108e6) ** (-1 / 3)


def resolve_recipe(cfg: RunConfig, budget: int, model: ModelConfig | None = None) -> Recipe:
    """The run's recipe at the budget `budget` (the scale's reference count, shared by every arm); with
    `train.micro_batch: auto`, split into the micro batch that fits the device with `model` (the matched one)."""
    t = cfg.train
    global_batch = t.global_batch or t.micro_batch * t.grad_accum
    world = cfg.cluster.ranks
    micro, accum = batch_layout(global_batch, t.micro_batch, world)
    tokens_per_step = global_batch * cfg.data.seq_len
    steps = t.max_steps or max(1, math.ceil(t.tokens_per_param * budget / tokens_per_step))
    if t.lr:
        lr, rule = t.lr, "train.lr"
    else:
        lr, rule = scaled_lr(budget), f"0.0047 (N / 108e6)^(-1/3) at the budget N = {budget:,}"
    recipe = Recipe(global_batch=global_batch, micro_batch=micro, grad_accum=accum, world_size=world, max_steps=steps,
                    tokens=steps * tokens_per_step, lr=lr, warmup_steps=t.warmup_steps or max(1, int(0.02 * steps)),
                    final_lr=t.final_lr or t.min_lr_ratio * lr, lr_rule=rule)
    recipe = replace(recipe, val_windows=recipe.validation_windows(t.val_batches))  # fixed now, at the planned layout
    if t.micro_batch_auto and model is not None:
        from study.plan.memory import estimable, fit_micro_batch

        # after the validation windows: they stay those of train.micro_batch, as the key does
        micro, accum = fit_micro_batch(cfg, estimable(model, budget, cfg.budget.mode), global_batch)
        recipe = replace(recipe, micro_batch=micro, grad_accum=accum)
    return recipe
