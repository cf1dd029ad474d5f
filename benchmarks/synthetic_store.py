"""Fill an MLflow store with plausible runs of a study, following the project's MLflow schema.

Used by tests and by the benchmark harness to exercise the report without training anything. The final
validation loss follows a Chinchilla-style law ``L(N) = E + A * N^(-alpha)`` plus a per-variant effect, a
seed effect shared by every variant at a (scale, seed) (what pairing cancels) and a small per-run noise; a variant
can instead be planted at an effective compute multiple of the baseline. Runs log the recipe's tokens and the
model's FLOPs per token, and their throughput; tune runs (an LR grid per variant) and tuned main runs follow the
tuning stage's tags. Everything is logged with ``log_batch``, about 0.3 s per 1000 points on SQLite.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from typing import Mapping, Sequence

import numpy as np

from study import schema
from study.schema import ITEMS_ARTIFACT, TAG_EVAL, eval_artifact
from study.track.store import get_or_create_experiment, mlflow_client

E_TRUE, A_TRUE, ALPHA_TRUE = 1.8, 400.0, 0.3
"""Loss law of the synthetic baseline (N = non-embedding parameters)."""

VOCAB = 4096
"""Vocabulary size: the loss starts near ln(VOCAB) at step 0."""

TOKENS_PER_PARAM, SEQ_LEN = 20, 1024
"""Training tokens per (non-embedding) parameter, shared by every arm of a scale, and the sequence length."""

BASE_LR = 3e-4
"""The recipe's peak LR of every synthetic run; a tuned or tune run trains at a multiple of it."""

SYNTHETIC_FLOPS = 1.6e14
"""Training FLOP/s of one synthetic job (a device at 40 % of 400 TFLOP/s): tokens/s = this / FLOPs per token."""

TASK_CHANCE = {"arc_easy": 0.25, "hellaswag": 0.25, "piqa": 0.5}
"""Chance accuracy of each synthetic downstream task."""

SYNTHETIC_EVAL = "synthetic"
"""Evaluation id of the synthetic runs' item scores."""

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9}


def synthetic_store(
    tracking_uri: str,
    experiment: str,
    variants: Sequence[str],
    scales: Sequence[str] | Mapping[str, int],
    seeds: int | Sequence[int],
    steps: int,
    *,
    baseline: str | None = None,
    effects: Mapping[str, float] | None = None,
    eval_tasks: Sequence[str] = tuple(TASK_CHANCE),
    eval_every: int | None = None,
    statuses: Mapping[tuple[str, str, int], str] | None = None,
    seed_sd: float = 0.02,
    run_sd: float = 0.004,
    rng_seed: int = 0,
    items_per_task: int = 0,
    compute_multipliers: Mapping[str, float] | None = None,
    flops_factors: Mapping[str, float] | None = None,
    speeds: Mapping[str, float] | None = None,
    recipe_params: bool = True,
    tuned: Mapping[str, tuple[float, str]] | None = None,
) -> list[str]:
    """Log one run per (variant, scale, seed) into ``experiment`` and return their run ids.

    ``scales`` maps a scale name to its counted parameters, or lists names whose size is read from the name
    (``"113M"``). ``steps`` training steps each log ``train/loss`` and ``train/lr``; ``val/loss``, ``val/ppl`` and
    ``train/tokens_per_s`` are logged every ``eval_every`` steps (default ``steps // 20``) and at the last one, then
    ``eval/<task>/acc`` and ``acc_norm`` once. ``effects`` shifts a variant's final loss (default: the
    baseline 0, each further variant 0.015 lower than the one before). ``statuses`` marks chosen runs
    ``FAILED`` or ``RUNNING`` (logged up to half-way, no evaluation) or ``MISSING`` (not logged).
    ``items_per_task`` > 0 also logs each finished run's per-item scores (the ``items.jsonl`` artifact an
    evaluation writes): item i of a task is answered correctly with a probability set by its shared difficulty
    and the run's accuracy, and its log-likelihood follows the run's loss.

    Compute: every arm of a scale trains the same ``TOKENS_PER_PARAM`` x N tokens (``recipe.tokens``, which is
    ``steps`` x ``recipe.global_batch`` x ``data.seq_len``) at ``resolved.flops_per_token`` = 6 N times the
    variant's ``flops_factors`` entry (default 1). The baseline law read in compute C = 6 N x 20 N is
    ``E + A (C / 120)^(-alpha/2)``; ``compute_multipliers`` plants a variant's effective compute k (default 1): its
    loss is that law at k times its own compute. Throughput is ``SYNTHETIC_FLOPS`` / FLOPs per token tokens/s,
    times the variant's ``speeds`` entry (default 1), with 1 % noise per logged step. ``recipe_params=False`` logs
    runs as they were before the resolved recipe: no ``recipe.*`` and no ``resolved.flops_per_token``.
    ``tuned`` maps a variant to (chosen LR multiple, ``interior``/``extended``/``edge``): its runs are main runs
    at that multiple of the recipe's LR (``study.lr_source=tune``); the others are at the shared LR
    (``study.lr_source=recipe``). A tuned and a shared-LR store of one experiment can share one MLflow experiment.
    """
    client = mlflow_client(tracking_uri)
    exp_id = get_or_create_experiment(client, tracking_uri, experiment)
    baseline = baseline or variants[0]
    effects = dict(effects) if effects is not None else {v: -0.015 * i for i, v in enumerate(variants)}
    sizes = _sizes(scales)
    seed_list = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    statuses = statuses or {}
    every = eval_every or max(1, steps // 20)
    rng = np.random.default_rng(rng_seed)
    # throughput noise draws from a stream of its own, so the losses of a given rng_seed stay what they were
    speed_rng = np.random.default_rng([rng_seed, 1])
    seed_effect = {(s, k): rng.normal(0.0, seed_sd) for s in sizes for k in seed_list}
    t0 = int(time.time() * 1000)
    run_ids = []
    for scale, n_params in sizes.items():
        for variant in variants:
            for k in seed_list:
                status = statuses.get((variant, scale, k), "FINISHED")
                if status == "MISSING":
                    continue
                factor = (compute_multipliers or {}).get(variant, 1.0) * (flops_factors or {}).get(variant, 1.0)
                # the law at k x its own compute is the law in N at N sqrt(k x flops factor) (C grows as N^2)
                final = (E_TRUE + A_TRUE * n_params ** -ALPHA_TRUE * factor ** (-ALPHA_TRUE / 2)
                         + effects.get(variant, 0.0) + seed_effect[scale, k] + rng.normal(0.0, run_sd))
                counted = n_params + int(rng.integers(-n_params // 200_000, n_params // 200_000 + 1))
                choice = (tuned or {}).get(variant)
                key_parts = (experiment, variant, scale, k) + (("tune", *choice) if choice else ())
                tags = {
                    schema.TAG_RUN_KEY: _run_key(*key_parts), schema.TAG_EXPERIMENT: experiment,
                    schema.TAG_VARIANT: variant, schema.TAG_SCALE: scale, schema.TAG_SEED: str(k),
                    schema.TAG_ROLE: "train", schema.TAG_BASELINE: baseline,
                    schema.TAG_LR_SOURCE: "tune" if choice else "recipe",
                }
                if choice:
                    tags.update({schema.TAG_TUNE_MULTIPLE: f"{choice[0]:g}", schema.TAG_TUNE_STATUS: choice[1]})
                params = _params(variant, scale, k, steps, counted, n_params, (flops_factors or {}).get(variant, 1.0),
                                 choice[0] if choice else 1.0, recipe_params)
                rate = SYNTHETIC_FLOPS / float(params.pop("flops_per_token")) * (speeds or {}).get(variant, 1.0)
                run_ids.append(_log_run(client, exp_id, f"{variant}-{scale}-s{k}", tags, params, final, status, steps,
                                        every, t0, rate, eval_tasks, items_per_task, rng, speed_rng, rng_seed))
    return run_ids


def synthetic_tune_runs(
    tracking_uri: str,
    experiment: str,
    variants: Sequence[str],
    scale: str | Mapping[str, int],
    multiples: Sequence[float],
    seeds: int | Sequence[int],
    steps: int,
    *,
    optimum: Mapping[str, float],
    curvature: float = 0.05,
    baseline: str | None = None,
    effects: Mapping[str, float] | None = None,
    run_sd: float = 0.002,
    rng_seed: int = 0,
) -> list[str]:
    """Log tune runs (``study.role=tune``): one per variant x LR multiple x seed at one scale.

    A tune run trains at ``multiple`` x the recipe's LR (param ``train.lr``, tag ``study.tune.multiple``); its
    final loss is the scale's law plus the variant's effect plus ``curvature`` x (ln multiple - ln optimum)^2, the
    variant's ``optimum`` multiple being the bottom of that parabola in log LR. They log curves and recipe params
    like main runs, and nothing else: no evaluation.
    """
    client = mlflow_client(tracking_uri)
    exp_id = get_or_create_experiment(client, tracking_uri, experiment)
    baseline = baseline or variants[0]
    effects = effects or {}
    (name, n_params), = _sizes([scale] if isinstance(scale, str) else scale).items()
    rng = np.random.default_rng(rng_seed)
    speed_rng = np.random.default_rng([rng_seed, 1])
    t0 = int(time.time() * 1000)
    run_ids = []
    for variant in variants:
        for multiple in multiples:
            for k in (range(seeds) if isinstance(seeds, int) else seeds):
                final = (E_TRUE + A_TRUE * n_params ** -ALPHA_TRUE + effects.get(variant, 0.0)
                         + curvature * math.log(multiple / optimum[variant]) ** 2 + rng.normal(0.0, run_sd))
                tags = {schema.TAG_RUN_KEY: _run_key(experiment, variant, name, k, "grid", multiple),
                        schema.TAG_EXPERIMENT: experiment, schema.TAG_VARIANT: variant, schema.TAG_SCALE: name,
                        schema.TAG_SEED: str(k), schema.TAG_ROLE: "tune", schema.TAG_BASELINE: baseline,
                        schema.TAG_TUNE_MULTIPLE: f"{multiple:g}"}
                params = _params(variant, name, k, steps, n_params, n_params, 1.0, multiple, True)
                params["train.lr"] = params["recipe.lr"]
                rate = SYNTHETIC_FLOPS / float(params.pop("flops_per_token"))
                run_ids.append(_log_run(client, exp_id, f"{variant}-{name}-s{k}-lr{multiple:g}", tags, params, final,
                                        "FINISHED", steps, max(1, steps // 20), t0, rate, (), 0, rng, speed_rng,
                                        rng_seed))
    return run_ids


def _log_run(client, exp_id: str, name: str, study_tags: dict, params: dict, final: float, status: str, steps: int,
             every: int, t0: int, rate: float, eval_tasks: Sequence[str], items_per_task: int,
             rng: np.random.Generator, speed_rng: np.random.Generator, rng_seed: int) -> str:
    """One run: curves up to the end (half-way unless FINISHED), evaluations when finished, then its status."""
    from mlflow.entities import Metric, Param, RunTag

    run = client.create_run(exp_id, start_time=t0, tags=study_tags, run_name=name)
    last = steps if status == "FINISHED" else steps // 2
    points = _curves(final, steps, last, every, t0, rng)
    points += [("train/tokens_per_s", rate * float(speed_rng.lognormal(0.0, 0.01)), t0 + s * 1000, s)
               for s in sorted({*range(every, last + 1, every), last})]
    if status == "FINISHED":
        points += _evals(final, eval_tasks, steps, t0 + steps * 1000, rng)
    params = [Param(key, str(value)) for key, value in params.items()]
    metrics = [Metric(key, value, ts, step) for key, value, ts, step in points]
    tags = [RunTag("mlflow.source.name", "benchmarks.synthetic_store")]
    if status == "FAILED":
        tags.append(RunTag(schema.TAG_FAILURE_REASON, "synthetic: loss became NaN"))
    # Each log_batch is one SQLite commit (1000 entities at most): params and tags ride in the first.
    head = 1000 - len(params) - len(tags)
    client.log_batch(run.info.run_id, metrics=metrics[:head], params=params, tags=tags)
    for start in range(head, len(metrics), 1000):
        client.log_batch(run.info.run_id, metrics=metrics[start:start + 1000])
    if items_per_task and status == "FINISHED":
        _log_items(client, run.info.run_id, final, eval_tasks, items_per_task, rng, rng_seed)
    if status != "RUNNING":
        client.set_terminated(run.info.run_id, status=status, end_time=t0 + last * 1000)
    return run.info.run_id


def _log_items(client, run_id: str, final: float, tasks: Sequence[str], n: int, rng: np.random.Generator,
               rng_seed: int) -> None:
    import json
    import tempfile
    from pathlib import Path

    from mlflow.entities import RunTag

    lines = []
    for t, task in enumerate(tasks):
        difficulty = np.random.default_rng([rng_seed, t]).normal(0.0, 1.0, n)  # the same items in every run
        chance = TASK_CHANCE.get(task, 0.25)
        skill = math.log((0.9 - chance) / (1 + math.exp(-2.5 * (3.3 - final)))) - math.log(chance)
        p = 1 / (1 + np.exp(-(skill - difficulty)))
        correct = rng.random(n) < p
        ll = -3.0 * final - 2.0 * difficulty + rng.normal(0.0, 0.3, n)
        lines += [json.dumps({"task": task, "doc_id": i, "acc": float(c), "acc_norm": float(c), "ll_correct": float(v),
                              "n_choices": round(1 / chance)}) for i, (c, v) in enumerate(zip(correct, ll))]
    # laid out as study.eval.records files a run's evaluation of record
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ITEMS_ARTIFACT
        path.write_text("\n".join(lines) + "\n")
        client.log_artifact(run_id, str(path), eval_artifact(SYNTHETIC_EVAL))
    client.log_batch(run_id, tags=[RunTag(TAG_EVAL + task, SYNTHETIC_EVAL) for task in tasks])


def _sizes(scales: Sequence[str] | Mapping[str, int]) -> dict[str, int]:
    if isinstance(scales, Mapping):
        return {name: int(n) for name, n in scales.items()}
    sizes = {}
    for i, name in enumerate(scales):
        match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmb])", name.lower())
        sizes[name] = int(float(match.group(1)) * _SUFFIX[match.group(2)]) if match else int(20e6 * 2 ** i)
    return sizes


def _run_key(*parts: object) -> str:
    return hashlib.sha1("/".join(map(str, parts)).encode()).hexdigest()[:12]


def _curves(final: float, steps: int, last: int, every: int, t0: int, rng: np.random.Generator) -> list[tuple]:
    """Train loss/lr at each step up to ``last``, val loss/ppl every ``every`` steps and at ``last``."""
    tau = max(steps / 20, 1.0)
    t = np.arange(1, last + 1)
    # Hyperbolic decay from ln(VOCAB) at step 0, rescaled to land exactly on `final` at the last step.
    decay, decay_end = tau / (t + tau), tau / (steps + tau)
    val = final + (math.log(VOCAB) - final) * (decay - decay_end) / (1 - decay_end)
    warmup = max(steps // 10, 1)
    lr = 3e-4 * np.where(t < warmup, t / warmup, 0.5 * (1 + np.cos(np.pi * (t - warmup) / max(steps - warmup, 1))))
    train = val - 0.02 + rng.normal(0.0, 0.03, size=last)
    points = [(key, float(v), t0 + int(s) * 1000, int(s))
              for s, tl, l in zip(t, train, lr, strict=True) for key, v in (("train/loss", tl), ("train/lr", l))]
    for s in sorted({*range(every, last + 1, every), last}):
        v = float(val[s - 1])
        points += [("val/loss", v, t0 + s * 1000, s), ("val/ppl", math.exp(v), t0 + s * 1000, s)]
    return points


def _evals(final: float, tasks: Sequence[str], step: int, ts: int, rng: np.random.Generator) -> list[tuple]:
    points = []
    for task in tasks:
        chance = TASK_CHANCE.get(task, 0.25)
        acc = chance + (0.9 - chance) / (1 + math.exp(-2.5 * (3.3 - final))) + rng.normal(0.0, 0.003)
        acc_norm = acc + 0.01 + rng.normal(0.0, 0.003)
        points += [(f"eval/{task}/acc", acc, ts, step), (f"eval/{task}/acc_norm", acc_norm, ts, step)]
    return points


def _params(variant: str, scale: str, seed: int, steps: int, counted: int, n_params: int, flops_factor: float,
            lr_multiple: float, recipe_params: bool) -> dict[str, object]:
    """The run's params as training logs them, plus ``flops_per_token`` (the caller's, never logged as such)."""
    d_model = 64 * max(1, round((counted / 12 / 12) ** 0.5 / 64))
    embedding = 2 * VOCAB * d_model
    attention = 4 * d_model * d_model * 12
    norm = d_model * 25
    global_batch = max(1, round(TOKENS_PER_PARAM * n_params / (steps * SEQ_LEN)))
    flops_per_token = 6.0 * n_params * flops_factor
    params: dict[str, object] = {
        "model.variant": variant, "model.d_model": d_model, "model.n_layers": 12, "model.vocab_size": VOCAB,
        "scale.name": scale, "train.max_steps": steps, "train.global_batch": global_batch, "train.lr": BASE_LR,
        "train.seed": seed, "data.name": "synthetic", "data.seq_len": SEQ_LEN,
        "params.embedding": embedding, "params.attention": attention, "params.ffn": counted - attention - norm,
        "params.norm": norm, "params.total": counted + embedding, "params.counted": counted,
        "flops_per_token": flops_per_token,
    }
    if recipe_params:
        params.update({"recipe.tokens": steps * global_batch * SEQ_LEN, "recipe.max_steps": steps,
                       "recipe.global_batch": global_batch, "recipe.lr": BASE_LR * lr_multiple,
                       "recipe.lr_rule": "train.lr", "resolved.flops_per_token": flops_per_token})
    return params
