"""Fill an MLflow store with plausible runs of a study, following the project's MLflow schema.

Used by tests and by the benchmark harness to exercise the report without training anything. The final
validation loss follows a Chinchilla-style law ``L(N) = E + A * N^(-alpha)`` plus a per-variant effect, a
seed effect shared by every variant at a (scale, seed) (what pairing cancels) and a small per-run noise.
Everything is logged with ``log_batch``, about 0.3 s per 1000 points on SQLite.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from typing import Mapping, Sequence

import numpy as np

from study.schema import ITEMS_ARTIFACT, TAG_EVAL, eval_artifact
from study.track.store import get_or_create_experiment, mlflow_client

E_TRUE, A_TRUE, ALPHA_TRUE = 1.8, 400.0, 0.3
"""Loss law of the synthetic baseline (N = non-embedding parameters)."""

VOCAB = 4096
"""Vocabulary size: the loss starts near ln(VOCAB) at step 0."""

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
) -> list[str]:
    """Log one run per (variant, scale, seed) into ``experiment`` and return their run ids.

    ``scales`` maps a scale name to its counted parameters, or lists names whose size is read from the name
    (``"113M"``). ``steps`` training steps each log ``train/loss`` and ``train/lr``; ``val/loss`` and
    ``val/ppl`` are logged every ``eval_every`` steps (default ``steps // 20``) and at the last one, then
    ``eval/<task>/acc`` and ``acc_norm`` once. ``effects`` shifts a variant's final loss (default: the
    baseline 0, each further variant 0.015 lower than the one before). ``statuses`` marks chosen runs
    ``FAILED`` or ``RUNNING`` (logged up to half-way, no evaluation) or ``MISSING`` (not logged).
    ``items_per_task`` > 0 also logs each finished run's per-item scores (the ``items.jsonl`` artifact an
    evaluation writes): item i of a task is answered correctly with a probability set by its shared difficulty
    and the run's accuracy, and its log-likelihood follows the run's loss.
    """
    from mlflow.entities import Metric, Param, RunTag

    client = mlflow_client(tracking_uri)
    exp_id = get_or_create_experiment(client, tracking_uri, experiment)
    baseline = baseline or variants[0]
    effects = dict(effects) if effects is not None else {v: -0.015 * i for i, v in enumerate(variants)}
    sizes = _sizes(scales)
    seed_list = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    statuses = statuses or {}
    every = eval_every or max(1, steps // 20)
    rng = np.random.default_rng(rng_seed)
    seed_effect = {(s, k): rng.normal(0.0, seed_sd) for s in sizes for k in seed_list}
    t0 = int(time.time() * 1000)
    run_ids = []
    for scale, n_params in sizes.items():
        for variant in variants:
            for k in seed_list:
                status = statuses.get((variant, scale, k), "FINISHED")
                if status == "MISSING":
                    continue
                final = (E_TRUE + A_TRUE * n_params ** -ALPHA_TRUE + effects.get(variant, 0.0)
                         + seed_effect[scale, k] + rng.normal(0.0, run_sd))
                counted = n_params + int(rng.integers(-n_params // 200_000, n_params // 200_000 + 1))
                study_tags = {
                    "study.run_key": _run_key(experiment, variant, scale, k), "study.experiment": experiment,
                    "study.variant": variant, "study.scale": scale, "study.seed": str(k), "study.stage": "train",
                    "study.baseline": baseline,
                }
                run = client.create_run(exp_id, start_time=t0, tags=study_tags, run_name=f"{variant}-{scale}-s{k}")
                last = steps if status == "FINISHED" else steps // 2
                points = _curves(final, steps, last, every, t0, rng)
                if status == "FINISHED":
                    points += _evals(final, eval_tasks, steps, t0 + steps * 1000, rng)
                params = [Param(key, str(value)) for key, value in _params(variant, scale, k, steps, counted).items()]
                metrics = [Metric(key, value, ts, step) for key, value, ts, step in points]
                tags = [RunTag("mlflow.source.name", "analysis.synthetic")]
                if status == "FAILED":
                    tags.append(RunTag("study.failure_reason", "synthetic: loss became NaN"))
                # Each log_batch is one SQLite commit (1000 entities at most): params and tags ride in the first.
                head = 1000 - len(params) - len(tags)
                client.log_batch(run.info.run_id, metrics=metrics[:head], params=params, tags=tags)
                for start in range(head, len(metrics), 1000):
                    client.log_batch(run.info.run_id, metrics=metrics[start:start + 1000])
                if items_per_task and status == "FINISHED":
                    _log_items(client, run.info.run_id, final, eval_tasks, items_per_task, rng, rng_seed)
                if status != "RUNNING":
                    client.set_terminated(run.info.run_id, status=status, end_time=t0 + last * 1000)
                run_ids.append(run.info.run_id)
    return run_ids


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
    # laid out as study.evaluate.records files a run's evaluation of record
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


def _params(variant: str, scale: str, seed: int, steps: int, counted: int) -> dict[str, object]:
    d_model = 64 * max(1, round((counted / 12 / 12) ** 0.5 / 64))
    embedding = 2 * VOCAB * d_model
    attention = 4 * d_model * d_model * 12
    norm = d_model * 25
    return {
        "model.variant": variant, "model.d_model": d_model, "model.n_layers": 12, "model.vocab_size": VOCAB,
        "scale.name": scale, "train.steps": steps, "train.lr": 3e-4, "train.seed": seed, "data.name": "synthetic",
        "params.embedding": embedding, "params.attention": attention, "params.ffn": counted - attention - norm,
        "params.norm": norm, "params.total": counted + embedding, "params.counted": counted,
    }
