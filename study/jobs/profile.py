"""`study profile`: the work profile of a trained run, written beside its checkpoints and logged to its MLflow run."""

from __future__ import annotations

import json
from pathlib import Path

from study.config.spec import RunSpec
from study.files import replace_file


def profile_run(spec: RunSpec, geometry=None) -> Path:
    """Profile the latest checkpoint of the run the spec describes, on the CPU; returns the profile.json path.
    `geometry` replaces the spec's profiling settings (`study profile RUN_KEY geometry.n_tokens=...`)."""
    from study.data import prepare_data, val_batches
    from study.data.batches import num_windows
    from study.eval.locate import load_trained_model
    from study.geometry.allocate import geometry_widths
    from study.geometry.clouds import collect_clouds, perturbation_sensitivity
    from study.geometry.plots import plot_profile, plot_widths
    from study.geometry.profile import profile_clouds
    from study.track.tracker import Tracker

    cfg, key = spec.config, spec.key
    g = geometry or cfg.geometry
    model, ckpt = load_trained_model(spec)
    data = prepare_data(cfg.data, build=False)  # reads the run's validation tokens, never tokenises
    # batches of `n_sequences` validation sequences (as many as the split holds, and at least enough positions for
    # twice the sampled tokens); the tokens are then drawn uniformly among all of them, a few per sequence
    per_batch = 8
    enough = max(g.n_sequences, -(-2 * g.n_tokens // max(data.seq_len - 1, 1)))
    wanted = min(-(-enough // per_batch), num_windows(len(data.val), data.seq_len) // per_batch)
    batches = [x for x, _ in val_batches(data.val, data.seq_len, per_batch, max(wanted, 1))]
    sensitivity = perturbation_sensitivity(model, batches, g.sensitivity_eps) if g.measure_sensitivity else None
    clouds = collect_clouds(model, batches, g.n_tokens, g.seed, g.min_position)
    profile = profile_clouds(clouds, g, sensitivity)
    profile["run_key"], profile["checkpoint"] = key, ckpt.name

    out = spec.run_dir.path
    path = spec.run_dir.profile
    replace_file(path, json.dumps(profile, indent=1))  # scheduled runs never see a half-written profile
    plot_profile(profile, out / "profile.png")

    uniform = spec.model.ffn.widths  # the reference's own (uniform) widths
    n = len(uniform)
    base = sum(uniform) / n
    schedules = {"uniform": uniform,
                 f"geometry ({g.statistic}/{g.geometry})": geometry_widths(profile, base, n, g),
                 f"reversed ({g.statistic}/{g.geometry})": geometry_widths(profile, base, n, g, reverse=True)}
    plot_widths(schedules, out / "widths.png")

    tracker = Tracker.attach(key, cfg.experiment, cfg=cfg.tracking)
    for name in ("profile.json", "profile.png", "widths.png"):
        tracker.log_artifact(out / name, f"geometry/{name}")
    tracker.close()
    return path
