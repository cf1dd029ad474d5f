"""Throughput for GPU-hour estimates: measured by `study calibrate` where a run's shape was calibrated, else
assumed (FLOPs per token at `train.assumed_mfu` of `train.gpu_peak_tflops`).

A calibration measures one shape (what sets a step's speed: the matched model, sequence length, micro batch,
precision, compilation, devices per job), so runs of any experiment that share it share the measurement: one finished
run per shape and cluster profile in the MLflow experiment `CALIBRATION_EXPERIMENT`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from study.config.identity import json_digest
from study.config.spec import RunSpec

CALIBRATION_EXPERIMENT = "study-calibration"
TAG_SHAPE, TAG_CLUSTER = "study.calibration.shape", "study.cluster"
TOKENS_PER_S, PER_DEVICE, MFU = ("calibration/tokens_per_s", "calibration/tokens_per_s_per_device",
                                 "calibration/mfu")


def devices(spec: RunSpec) -> int:
    """Devices one job of the run uses: its GPUs, or its processes on a CPU-only profile."""
    return max(1, spec.config.cluster.ranks)


def shape_key(spec: RunSpec) -> str:
    """What sets the step time of `spec`'s job, hashed (12 hex characters)."""
    t = spec.config.train
    return json_digest({"model": asdict(spec.model), "seq_len": spec.config.data.seq_len, "micro_batch": t.micro_batch,
                        "precision": t.precision, "compile": t.compile,
                        "activation_checkpointing": t.activation_checkpointing, "devices": devices(spec)})


@dataclass(frozen=True)
class Measured:
    tokens_per_s_per_device: float
    """Tokens per second per device the calibration job reached (median over its logged steps after warm-up)."""
    cluster: str
    """The cluster profile it was measured on."""
    mfu: float | None = None
    """Model FLOPs utilisation (GPU only)."""


def measured(tracking_uri: str = "") -> dict[str, dict[str, Measured]]:
    """shape key -> cluster profile -> its latest finished calibration; empty when nothing was calibrated."""
    from study.track.store import read_per_version, resolve_tracking_uri

    def read() -> dict:
        from study.track.query import all_runs, experiment_of, open_store, readable

        client = open_store(tracking_uri)
        with readable(resolve_tracking_uri(tracking_uri)):
            exp = experiment_of(client, CALIBRATION_EXPERIMENT)
            runs = [] if exp is None else list(all_runs(client, exp.experiment_id, "attributes.status = 'FINISHED'"))
        out: dict[str, dict[str, list]] = {}
        for run in sorted(runs, key=lambda r: r.info.start_time):  # the latest calibration of a shape wins
            m, tags = run.data.metrics, run.data.tags
            if PER_DEVICE in m and TAG_SHAPE in tags:
                out.setdefault(tags[TAG_SHAPE], {})[tags.get(TAG_CLUSTER, "?")] = [
                    m[PER_DEVICE], tags.get(TAG_CLUSTER, "?"), m.get(MFU)]
        return out

    kept = read_per_version(tracking_uri, ["calibrations"], read)
    return {shape: {cluster: Measured(*fields) for cluster, fields in per.items()} for shape, per in kept.items()}


@dataclass(frozen=True)
class Estimate:
    gpu_hours: float | None
    """Device-hours of the run (GPU-hours on a GPU profile)."""
    source: str
    """`measured on <cluster>` or `assumed <mfu> MFU`."""
    tokens_per_s: float | None = None
    """Tokens per second of the whole job, when measured."""


def estimate(spec: RunSpec, calibrations: dict[str, dict[str, Measured]]) -> Estimate:
    """The run's device-hours from its shape's measurement (its own cluster profile's first), else the assumed MFU."""
    found = calibrations.get(shape_key(spec), {}) if calibrations else {}
    figure = found.get(spec.config.cluster.name) or next(iter(found.values()), None)
    if figure is not None and figure.tokens_per_s_per_device > 0:
        n = devices(spec)
        rate = figure.tokens_per_s_per_device * n
        return Estimate(spec.tokens() / rate / 3600 * n, f"measured on {figure.cluster}", rate)
    return Estimate(spec.gpu_hours(), f"assumed {spec.config.train.assumed_mfu:.0%} MFU")
