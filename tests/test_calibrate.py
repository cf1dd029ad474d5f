"""`study calibrate`: one short job per distinct shape on the cluster profile, the measured throughput in MLflow, and
`study plan` taking GPU-hours from it (measured where calibrated, assumed elsewhere, and saying which)."""

from __future__ import annotations

import json
import statistics

import pytest

from slurm_helpers import private_sweeps, slurm_available
from study.cli import main


def test_plan_hours_come_from_the_measurement_of_each_runs_shape_else_from_the_assumed_mfu():
    from study.plan.planner import plan_experiment
    from study.plan.throughput import Measured, devices, estimate, shape_key

    plan = plan_experiment("demo", ["cluster=slurm"])
    conv = [r for r in plan.runs if r.config.variant == "conventional"]
    others = [r for r in plan.runs if r.config.variant != "conventional"]
    assert len({shape_key(r) for r in conv}) == 1  # seeds share a shape
    assert len({shape_key(r) for r in plan.runs}) == 3  # three variants, three shapes
    calibrations = {shape_key(conv[0]): {"slurm": Measured(1234.5, "slurm")}}
    for run in conv:
        est = estimate(run, calibrations)
        n = devices(run)
        assert est.source == "measured on slurm" and est.tokens_per_s == pytest.approx(1234.5 * n)
        assert est.gpu_hours == pytest.approx(run.tokens() / (1234.5 * n) / 3600 * n, rel=1e-12)
    for run in others:
        t = run.config.train
        est = estimate(run, calibrations)
        assert est.source == "assumed 40% MFU" and est.tokens_per_s is None
        assert est.gpu_hours == pytest.approx(run.tokens() * run.flops_per_token
                                              / (t.gpu_peak_tflops * 1e12 * t.assumed_mfu) / 3600, rel=1e-12)


@pytest.mark.no_store
def test_too_few_calibration_steps_are_refused_before_anything_is_submitted(workdir, capsys):
    assert main(["calibrate", "demo", "--steps", "3"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert not (workdir / "runs").exists() and not (workdir / "mlflow.db").exists()


@pytest.mark.integration
@pytest.mark.slurm
@pytest.mark.xdist_group("slurm")
@pytest.mark.skipif(not slurm_available(), reason="no SLURM cluster: run `eval \"$(slurm/local/up)\"`")
def test_calibrate_on_slurm_measures_each_shape_once_and_plan_reads_it(workdir, monkeypatch, capsys):
    from mlflow import MlflowClient

    from study.plan.throughput import CALIBRATION_EXPERIMENT, PER_DEVICE, TAG_SHAPE, TOKENS_PER_S

    private_sweeps(workdir, "calib")
    monkeypatch.setenv("STUDY_SWEEPS", str(workdir / "sweeps"))
    uri = f"sqlite:///{workdir}/mlflow.db"  # a store of its own: calibrations are shared across experiments
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert main(["calibrate", "calib", "cluster=slurm", "--steps", "8"]) == 0
    first = capsys.readouterr().out
    assert "2 shapes on slurm" in first and first.count("measured    ") == 2
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(CALIBRATION_EXPERIMENT).experiment_id])
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}
    for run in runs:  # the figure is the median of the steady-state steps, per device (one CPU task here)
        steady = [m.value for m in client.get_metric_history(run.info.run_id, "train/tokens_per_s") if m.step > 2]
        assert len(steady) == 6
        assert run.data.metrics[TOKENS_PER_S] == pytest.approx(statistics.median(steady), rel=1e-12)
        assert run.data.metrics[PER_DEVICE] == run.data.metrics[TOKENS_PER_S]
    assert main(["calibrate", "calib", "cluster=slurm", "--steps", "8"]) == 0
    again = capsys.readouterr().out
    assert "shapes on slurm" not in again and again.count("calibrated  ") == 2  # nothing submitted twice
    assert main(["plan", "calib", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["runs"]
    by_shape = {r.data.tags[TAG_SHAPE]: r.data.metrics[PER_DEVICE] for r in runs}
    from study.plan.planner import plan_experiment
    from study.plan.throughput import shape_key

    specs = {s.key: s for s in plan_experiment("calib", []).runs}
    for row in planned:
        rate = by_shape[shape_key(specs[row["run_key"]])]
        assert row["gpu_hours_from"] == "measured on slurm" and row["tokens_per_s"] == pytest.approx(rate)
        assert row["gpu_hours"] == pytest.approx(row["tokens"] / rate / 3600, rel=1e-12)
