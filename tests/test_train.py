"""One training run, for real: loss falls, MLflow holds the schema, resume is exact, NaN fails cleanly."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import TINY, TRAINING_RUNS, new_store
from study.train.distributed import Dist
from study.plan.planner import select_run
from study.train.loop import batch_stream, train


def cfg_for(*extra):
    return select_run([*TINY, "experiment=unit", *extra])


def mlflow_runs(experiment="unit", db="mlflow.db"):
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{os.getcwd()}/{db}")
    return mlflow.search_runs(experiment_names=[experiment], filter_string=TRAINING_RUNS, output_format="list")


def test_the_lr_schedule_a_run_trains_on_is_its_recipes_not_its_configs():
    """The schedule is resolved once into the spec's recipe: a run whose config's schedule fields changed after
    planning (cosine, another decay fraction, warm-up and end) still trains the planned WSD schedule, step by step."""
    from dataclasses import replace

    import torch

    from study.train.optim import build_optimizer, build_scheduler

    spec = cfg_for("train.lr_schedule=wsd", "train.max_steps=20", "train.warmup_steps=2", "train.decay_fraction=0.5",
                   "train.lr=1e-3", "train.final_lr=1e-4")
    later = replace(spec.config.train, lr_schedule="cosine", decay_fraction=0.1, warmup_steps=5, final_lr=0.0,
                    min_lr_ratio=0.5, lr=2e-3)
    spec = replace(spec, config=replace(spec.config, train=later))
    optimizer = build_optimizer(torch.nn.Linear(2, 2), spec.config.train, spec.planned.lr)
    scheduler = build_scheduler(optimizer, spec.planned, 0)
    seen = []
    for _ in range(21):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    # warm-up over 2 steps, the peak up to step 20 - int(0.5 x 20) = 10, then linear down to 1e-4 at step 20
    expected = [5e-4, 1e-3] + [1e-3] * 8 + [1e-3 - (1e-3 - 1e-4) * (s - 10) / 10 for s in range(10, 21)]
    assert seen == pytest.approx(expected, rel=1e-12, abs=0)


@pytest.mark.integration
def test_loss_falls_and_one_finished_run_holds_the_schema(workdir):
    cfg = cfg_for("train.max_steps=30", "train.val_interval=10", "train.lr=3e-3")
    out = train(cfg)
    assert out.status == "FINISHED" and out.step == 30
    assert out.losses[30] < out.losses[1] - 0.7
    runs = mlflow_runs()
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "conventional-tiny-s0"
    tags = run.data.tags
    assert tags["study.run_key"] == cfg.key and tags["study.variant"] == "conventional"
    assert tags["study.scale"] == "tiny" and tags["study.seed"] == "0" and tags["study.role"] == "train"
    assert tags["study.experiment"] == "unit" and tags["study.baseline"] == "conventional"
    params = run.data.params
    assert params["model.d_model"] == "64" and int(params["params.counted"]) > 0
    assert "cluster.name" not in params  # launch-only sections never become params
    from mlflow import MlflowClient

    hist = MlflowClient().get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in hist] == list(range(1, 31))
    val = MlflowClient().get_metric_history(run.info.run_id, "val/loss")
    assert [m.step for m in val] == [10, 20, 30] and val[-1].value == pytest.approx(out.val_loss)
    assert run.data.metrics["val/ppl"] == pytest.approx(2.718281828 ** out.val_loss, rel=1e-6)


@pytest.mark.integration
def test_resume_after_preemption_reproduces_the_uninterrupted_losses(workdir):
    common = ["train.max_steps=12", "train.ckpt_interval=4", "train.val_interval=6"]
    full = train(cfg_for(*common, "paths.runs=full", f"tracking.uri={new_store(workdir / 'full.db')}"))
    first = train(cfg_for(*common, "paths.runs=cut", "faults.stop_at_step=6"))
    assert first.status == "PREEMPTED" and first.step == 6
    assert mlflow_runs()[0].info.status == "KILLED"
    second = train(cfg_for(*common, "paths.runs=cut"))
    assert second.status == "FINISHED" and min(second.losses) == 7
    for step in range(7, 13):
        assert second.losses[step] == full.losses[step]  # bit-identical, not approximately equal
    assert second.val_loss == full.val_loss
    runs = mlflow_runs()
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # the preempted run resumed, not duplicated
    assert runs[0].data.tags["study.restarts"] == "1"
    from mlflow import MlflowClient

    hist = MlflowClient().get_metric_history(runs[0].info.run_id, "train/loss")
    assert sorted(m.step for m in hist) == list(range(1, 13))


def test_paired_runs_of_two_variants_see_identical_batches(workdir):
    from study.data import prepare_data

    a, b = cfg_for("variant=conventional"), cfg_for("model=hourglass", "model.ffn.hidden_ratio=0.25")
    assert a.key != b.key
    data = prepare_data(a.config.data)
    d = Dist(0, 1, 0, "cpu")
    with batch_stream(a, data, d, 3) as sa, batch_stream(b, data, d, 3) as sb:
        for _ in range(3):
            (xa, ya), (xb, yb) = next(sa)[0], next(sb)[0]
            assert xa.equal(xb) and ya.equal(yb)
    with batch_stream(cfg_for("seed=1"), data, d, 3) as sc, batch_stream(a, data, d, 3) as sa:
        assert not next(sc)[0][0].equal(next(sa)[0][0])


@pytest.mark.integration
def test_nan_loss_fails_the_run_with_its_reason(workdir):
    out = train(cfg_for("train.max_steps=8", "faults.nan_at_step=5"))
    assert out.status == "FAILED" and "nan" in out.reason.lower() and out.step == 5
    run = mlflow_runs()[0]
    assert run.info.status == "FAILED" and "step 5" in run.data.tags["study.failure_reason"]


@pytest.mark.integration
@pytest.mark.distributed
def test_two_process_fsdp_resume_reproduces_the_uninterrupted_run(workdir):
    def run(*extra):
        cmd = [sys.executable, "-m", "study.cli", "train", "--nproc", "2", *TINY, "experiment=unit",
               "train.max_steps=8", "train.ckpt_interval=4", "train.val_interval=4", "train.global_batch=8", *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=workdir, env=os.environ)

    full = run("paths.runs=full", f"tracking.uri={new_store(workdir / 'full.db')}")
    assert full.returncode == 0, full.stderr[-3000:]
    cut = run("paths.runs=cut", "faults.stop_at_step=5")
    assert cut.returncode == 75, cut.stderr[-3000:]
    resumed = run("paths.runs=cut")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    from mlflow import MlflowClient

    runs = mlflow_runs()
    assert len(runs) == 1  # one run per key, even across world-size-2 restarts
    hist = MlflowClient().get_metric_history(runs[0].info.run_id, "train/loss")
    assert sorted(m.step for m in hist) == list(range(1, 9))  # no step lost, none duplicated
    # the resumed run's final validation equals the uninterrupted one's, read from each run directory
    import json

    key = runs[0].data.tags["study.run_key"]
    a = json.loads((workdir / "full" / "unit" / key / "result.json").read_text())
    b = json.loads((workdir / "cut" / "unit" / key / "result.json").read_text())
    assert a["val_loss"] == b["val_loss"]


@pytest.mark.integration
@pytest.mark.distributed
def test_compiled_blocks_train_as_the_eager_model_on_two_fsdp_ranks_with_recomputation(workdir):
    """`train.compile` compiles each block whole (fullgraph) inside FSDP2's hooks and the recomputation wrapper, with
    inductor's CPU code: a sharded, checkpointed model trains to the losses of the same run trained eagerly on one rank
    (the same global batch, split over the ranks). Every shipped block traces whole (test_preflight_shipped.py); the
    conventional one compiles here in 40 CPU s from a cold cache, an hourglass's K sub-MLPs in 65."""
    import json

    run = ["train.max_steps=4", "train.val_interval=4", "train.global_batch=8"]
    eager = train(cfg_for(*run, "paths.runs=eager", "train.compile=false"))
    cmd = [sys.executable, "-m", "study.cli", "train", "--nproc", "2", *TINY, "experiment=unit", *run,
           "paths.runs=compiled", f"tracking.uri={new_store(workdir / 'compiled.db')}", "train.compile=true",
           "train.activation_checkpointing=true"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=workdir, env=os.environ)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = (workdir / "compiled" / "unit").glob("*/result.json")
    points = [json.loads(line) for line in (result.parent / "metrics.jsonl").read_text().splitlines()]
    losses = {step: value for name, value, _, step in points if name == "train/loss"}
    assert json.loads(result.read_text())["val_loss"] == pytest.approx(eager.val_loss, rel=1e-4)
    assert sorted(losses) == [1, 2, 3, 4] and losses == pytest.approx(dict(eager.losses), rel=1e-4)


@pytest.mark.no_store
def test_a_validation_split_smaller_than_one_batch_is_refused_before_the_first_step(workdir):
    from study.errors import StudyError

    spec = cfg_for("train.max_steps=4", "data.val_fraction=0.0007", "train.micro_batch=64", "train.global_batch=64")
    with pytest.raises(StudyError) as err:
        train(spec)
    assert err.value.field == "data.val_fraction" and "fewer than one validation batch of 64" in err.value.problem
    assert not (spec.run_dir.path / "checkpoints").exists() and not (workdir / "mlflow.db").exists()


@pytest.mark.integration
def test_callbacks_see_the_loss_then_validation_then_the_stop_then_the_checkpoint_of_a_step(workdir, monkeypatch):
    """The loop's fixed callback order, seen by the fault callback: at step 6 the training loss is logged, then the
    validation loss, then the injected stop is asked for, then the checkpoint of step 6 is about to be saved (step 3's
    is the only one complete), and the run stops there. The values a callback sees are the ones MLflow holds."""
    from mlflow import MlflowClient

    from study.train import checkpoint
    from study.train.callbacks import FaultHooks

    spec = cfg_for("train.max_steps=12", "train.log_interval=2", "train.val_interval=3", "train.ckpt_interval=3",
                   "faults.stop_at_step=6")
    events = []

    def saved():
        return [int(p.name.split("_")[1]) for p in checkpoint.complete_checkpoints(spec.run_dir.path)]

    inject = FaultHooks.before_stop  # the injected stop itself, recorded after it acts

    def before_stop(self, step, stop):
        inject(self, step, stop)
        events.append(("stop", step, stop.requested))

    monkeypatch.setattr(FaultHooks, "before_stop", before_stop)
    monkeypatch.setattr(FaultHooks, "on_log", lambda self, step, loss, tps: events.append(("log", step, loss)))
    monkeypatch.setattr(FaultHooks, "on_validation", lambda self, step, loss: events.append(("validation", step, loss)))
    monkeypatch.setattr(FaultHooks, "before_checkpoint", lambda self, step: events.append(("checkpoint", step, saved())))
    out = train(spec)
    assert out.status == "PREEMPTED" and out.step == 6 and sorted(out.losses) == [2, 4, 6]
    run_id = mlflow_runs()[0].info.run_id
    val = {m.step: m.value for m in MlflowClient().get_metric_history(run_id, "val/loss")}
    loss = {m.step: m.value for m in MlflowClient().get_metric_history(run_id, "train/loss")}
    assert sorted(val) == [3, 6] and sorted(loss) == [2, 4, 6]
    assert events == [("stop", 1, False),
                      ("log", 2, loss[2]), ("stop", 2, False),
                      ("validation", 3, val[3]), ("stop", 3, False), ("checkpoint", 3, []),
                      ("log", 4, loss[4]), ("stop", 4, False),
                      ("stop", 5, False),
                      ("log", 6, loss[6]), ("validation", 6, val[6]), ("stop", 6, True), ("checkpoint", 6, [3])]
    assert [loss[s] for s in (2, 4, 6)] == [out.losses[s] for s in (2, 4, 6)]
    assert saved() == [3, 6]


def test_validation_is_the_mean_over_a_fixed_set_of_windows_whatever_the_micro_batch(workdir):
    """What a resume on another world size or a smaller micro batch scores is the same windows, so the same loss: the
    mean of each of the first `val_windows` windows' own loss, computed here window by window."""
    import torch
    import torch.nn.functional as F

    from study.data import prepare_data
    from study.data.batches import gather_windows, to_tensors
    from study.models.transformer import build_model
    from study.train.callbacks import validate

    spec = cfg_for()
    data = prepare_data(spec.config.data, model_vocab=spec.model.vocab_size)
    model = build_model(spec.model, "cpu", seed=0)
    windows = 7
    assert spec.planned.validation_windows(spec.config.train.val_batches) == spec.planned.val_windows > 0
    with torch.no_grad():
        own = []
        for w in range(windows):
            x, y = to_tensors(gather_windows(data.val, data.seq_len, np.array([w])))
            own.append(F.cross_entropy(model(x)[0].float(), y[0]).item())
    expected = sum(own) / windows
    one = Dist(rank=0, world_size=1, local_rank=0, device="cpu")
    got = [validate(model, data, windows, one, micro) for micro in (1, 3, 4, 7)]
    assert got == pytest.approx([expected] * 4, rel=1e-6)
    assert model.training  # validation hands the model back in training mode


@pytest.mark.integration
def test_a_term_before_the_loop_takes_the_signals_stops_the_run_at_its_first_step_with_a_checkpoint(workdir):
    """A local launch stopped while its jobs still set up (imports, data, model): the TERM is kept from the job's
    first moment (what TrainJob does), so the run checkpoints its first step and stops instead of training on until
    the launcher's grace period kills it; the next start resumes and finishes."""
    import signal

    from study.train import checkpoint
    from study.train.signals import catch_early

    spec = cfg_for("train.max_steps=6", "train.ckpt_interval=3")
    previous = signal.getsignal(signal.SIGTERM)
    try:
        catch_early()
        os.kill(os.getpid(), signal.SIGTERM)  # arrives before train() has built anything
        stopped = train(spec)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (stopped.status, stopped.step, stopped.reason) == ("PREEMPTED", 1, "stopped by SIGTERM at step 1")
    assert [p.name for p in checkpoint.complete_checkpoints(spec.run_dir.path)] == ["step_00000001"]
    resumed = train(spec)
    assert (resumed.status, resumed.step, sorted(resumed.losses)) == ("FINISHED", 6, [2, 3, 4, 5, 6])
