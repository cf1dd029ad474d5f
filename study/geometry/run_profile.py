"""`study profile`: the work profile of a trained run, written beside its checkpoints and logged to its MLflow run."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from study.config import RunConfig, run_key
from study.schedules import cosine_taper


def profiling_batches(cfg: RunConfig, data, n_tokens: int):
    """Validation sequences holding at least twice the sampled tokens (positions are sampled among them)."""
    from study.data import val_batches

    per_batch = 8
    wanted = max(1, (2 * n_tokens) // (data.seq_len * per_batch) + 1)
    return [x for x, _ in val_batches(data.val, data.seq_len, per_batch, wanted)]


def profile_run(cfg: RunConfig, device: str = "cpu", key: str | None = None) -> Path:
    """Profile the latest checkpoint of the run `cfg` describes; returns the profile.json path. `key` names the run
    when `cfg.geometry` carries profiling settings other than the ones it was trained with."""
    from study.data import prepare_data
    from study.evaluation_run import load_trained_model
    from study.geometry.clouds import collect_clouds, perturbation_sensitivity
    from study.geometry.plots import plot_profile, plot_widths
    from study.geometry.profile import profile_clouds
    from study.geometry.schedule import geometry_widths
    from study.plan import resolve_model, run_dir
    from study.tracking import Tracker

    key = key or run_key(cfg)
    g = cfg.geometry
    model, ckpt = load_trained_model(cfg, device, key)
    data = prepare_data(cfg.data)
    batches = profiling_batches(cfg, data, g.n_tokens)
    sensitivity = perturbation_sensitivity(model, batches, g.sensitivity_eps) if g.measure_sensitivity else None
    clouds = collect_clouds(model, batches, g.n_tokens, g.seed, g.min_position)
    profile = profile_clouds(clouds, g, sensitivity)
    profile["run_key"], profile["checkpoint"] = key, ckpt.name

    out = run_dir(cfg, key)
    path = out / "profile.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(profile, indent=1))
    os.replace(tmp, path)  # scheduled runs never see a half-written profile
    plot_profile(profile, out / "profile.png")

    matched = resolve_model(cfg)  # the reference's own (uniform) widths
    uniform = matched.model.ffn.widths
    n = len(uniform)
    base = sum(uniform) / n
    schedules = {"uniform": uniform, "cosine": cosine_taper(n, base, cfg.model.ffn.cosine_start, cfg.model.ffn.cosine_end),
                 f"geometry ({g.statistic}/{g.geometry})": geometry_widths(profile, base, n, g),
                 f"anti ({g.statistic}/{g.geometry})": geometry_widths(profile, base, n, replace(g, anti=True))}
    plot_widths(schedules, out / "widths.png")

    tracker = Tracker.attach(key, cfg.experiment, cfg=cfg.tracking)
    for name in ("profile.json", "profile.png", "widths.png"):
        tracker.log_artifact(out / name, f"geometry/{name}")
    tracker.close()
    return path
