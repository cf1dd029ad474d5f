"""The resolved training recipe of one run (steps, batch, the whole LR schedule) and its resolver: the planner derives
it once from the config and the scale's budget (the reference model's count, so every arm of a comparison trains the
same tokens under the same schedule) and stores it in the run spec; the job reads it without recomputing it. It lives
in study.config because the run spec carries it; the planner passes in the one plan-level input, `fit`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from study.config.run import RunConfig
from study.config.training import TrainConfig
from study.errors import StudyError


@dataclass
class Recipe:
    global_batch: int
    """Sequences per optimizer step, whatever the world size (`train.global_batch`, else micro_batch x grad_accum)."""
    micro_batch: int
    """Sequences per rank per forward pass at the planned world size (at most `train.micro_batch`)."""
    grad_accum: int
    """Micro batches per optimizer step on each rank at the planned world size."""
    world_size: int
    """Ranks the plan was resolved for (the cluster profile's); another world size splits the same global batch."""
    max_steps: int
    """Optimizer steps: `train.max_steps`, else ceil(tokens_per_param x budget / tokens per step)."""
    tokens: int
    """Training tokens: max_steps x global_batch x seq_len."""
    lr: float
    """Peak learning rate: `train.lr`, else the OLMo ladder rule at the scale's budget."""
    warmup_steps: int
    """Linear warm-up steps: `train.warmup_steps`, else 2 % of max_steps (at least 1)."""
    final_lr: float
    """Learning rate at the last step (`final_lr_for`): `train.final_lr`, else min_lr_ratio x lr; never above lr."""
    lr_rule: str
    """Where `lr` came from, in words (shown by `study plan`)."""
    lr_schedule: str
    """The decay after warm-up, `train.lr_schedule` (`cosine` or `wsd`); older specs take their config's."""
    decay_fraction: float
    """Share of max_steps a `wsd` schedule decays over, `train.decay_fraction` (`decay_start`)."""
    val_windows: int = 0
    """Held-out windows every validation pass scores (the first of the split): `train.val_batches` x micro_batch x
    world_size at the planned layout, fixed so every world size and micro batch scores the same; 0 in older specs."""

    def validation_windows(self, val_batches: int) -> int:
        """Windows a validation pass scores (specs written before `val_windows`: `val_batches` planned batches)."""
        return self.val_windows or val_batches * self.micro_batch * self.world_size


SCHEDULE = ("lr_schedule", "decay_fraction")
"""Recipe fields taken unchanged from `train.*`: a spec written before the recipe carried them reads its config's."""


def scaled_lr(n_params: int) -> float:
    """OLMo-core model ladder: lr = 0.0047 * (N / 108e6) ** (-1/3), N the non-embedding parameter count."""
    return 0.0047 * (n_params / 108e6) ** (-1 / 3)


def final_lr_for(t: TrainConfig, lr: float) -> float:
    """The LR at the last step of a run peaking at `lr`: `train.final_lr`, else min_lr_ratio x lr, capped at `lr` (a
    schedule never climbs back above its peak, e.g. when a scaled or tuned peak falls below `train.final_lr`)."""
    return min(lr, t.final_lr or t.min_lr_ratio * lr)


def decay_start(steps: int, fraction: float) -> int:
    """The step a `wsd` run of `steps` steps starts its linear decay at: its last int(fraction x steps) decay."""
    return steps - int(fraction * steps)


def resolve_recipe(cfg: RunConfig, budget: int, fit: Callable[[int], tuple[int, int]] | None = None) -> Recipe:
    """The run's recipe at the scale's reference count `budget`. With `train.micro_batch: auto`, `fit` maps the
    global batch to the (micro batch, accumulation steps) that fit the device (study.plan.memory)."""
    t = cfg.train
    global_batch = t.global_batch or t.micro_batch * t.grad_accum
    world = cfg.cluster.ranks
    micro, accum = batch_layout(global_batch, t.micro_batch, world)
    tokens_per_step = global_batch * cfg.data.seq_len
    steps = t.max_steps or max(1, math.ceil(t.tokens_per_param * budget / tokens_per_step))
    ladder = f"0.0047 (N / 108e6)^(-1/3) at the budget N = {budget:,}"
    lr, rule = (t.lr, "train.lr") if t.lr else (scaled_lr(budget), ladder)
    recipe = Recipe(global_batch=global_batch, micro_batch=micro, grad_accum=accum, world_size=world, max_steps=steps,
                    tokens=steps * tokens_per_step, lr=lr, warmup_steps=t.warmup_steps or max(1, int(0.02 * steps)),
                    final_lr=final_lr_for(t, lr), lr_rule=rule, lr_schedule=t.lr_schedule,
                    decay_fraction=t.decay_fraction)
    recipe = replace(recipe, val_windows=recipe.validation_windows(t.val_batches))  # fixed now, at the planned layout
    if t.micro_batch_auto and fit is not None:
        # after the validation windows: they stay those of train.micro_batch, as the key does
        micro, accum = fit(global_batch)
        recipe = replace(recipe, micro_batch=micro, grad_accum=accum)
    return recipe


PENDING = "pending"
"""`Tuned.status` of a main run whose variant's tuning has not decided yet."""


@dataclass
class Tuned:
    """Where a run's peak LR comes from when its experiment declares tuning."""

    multiple: float
    """The multiple of the recipe's peak LR the run trains at: a tune point's own, or its variant's choice."""
    status: str
    """Tune runs: `grid` or `extension` (beyond an edge); main runs: `interior`, `extended`, `edge` or `pending`."""
    record: str
    """The variant's tuning record (`<runs>/<experiment>/_tune/<variant>.json`)."""


@dataclass
class BranchPoint:
    """One decay branch of a run (`branches:`): a WSD run of `length` steps whose first `start` are its trunk's, so it
    starts from the trunk's checkpoint at `start` and decays over the rest."""

    at: float
    """Its length as a fraction of the run's planned steps (`branches.at`)."""
    length: int
    """Its steps: round(at x the run's max_steps)."""
    start: int
    """The trunk step it starts from, where a straight WSD run of `length` steps starts decaying (`decay_start`)."""


def batch_layout(global_batch: int, micro_batch: int, world: int,
                 field: str = "train.global_batch") -> tuple[int, int]:
    """(micro batch, accumulation steps) per rank that split `global_batch` sequences over `world` ranks: the largest
    micro batch up to `micro_batch` that divides each rank's share (a step's batch depends on the global batch alone,
    so a run resumed on another world size continues the same batches)."""
    per_rank, rem = divmod(global_batch, world)
    if rem or per_rank == 0:
        raise StudyError(field, f"{global_batch} sequences do not split evenly over {world} ranks",
                         f"use a multiple of the number of ranks ({world}), or run on a world size dividing it")
    micro = next(m for m in range(min(micro_batch, per_rank), 0, -1) if per_rank % m == 0)
    return micro, per_rank // micro
