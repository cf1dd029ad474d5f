"""Helpers for tests that launch experiments: a private sweeps tree with a small experiment, and job waiting."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import yaml

from conftest import ROOT

SMALL = {
    "description": "two tiny variants, one seed, for launcher tests",
    "baseline": "conventional",
    "scales": ["tiny"],
    "seeds": [0],
    "variants": {"conventional": {"model": "conventional"}, "hourglass": {"model": "hourglass"}},
    "common": {
        "model": {"n_layers": 2, "d_model": 64, "n_heads": 2, "ffn": {"width": 128}, "max_seq_len": 32,
                  "vocab_size": 512},
        "data": {"seq_len": 32, "max_docs": 1500, "vocab_size": 512, "val_fraction": 0.05},
        "train": {"max_steps": 16, "ckpt_interval": 4, "val_interval": 8, "micro_batch": 4, "val_batches": 2,
                  "warmup_steps": 2, "lr": 3e-3},
        "budget": {"tolerance": 1e-2},
    },
}


def private_sweeps(tmp: Path, name: str = "small", **changes) -> Path:
    """A copy of sweeps/ with one more experiment file (point STUDY_SWEEPS at `tmp/sweeps`; jobs inherit it)."""
    tree = tmp / "sweeps"
    if not tree.exists():
        shutil.copytree(ROOT / "sweeps", tree)
    spec = {**SMALL, **changes}
    (tree / "experiment" / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    return tree


def wait_jobs(job_ids: list[str], timeout: float = 600) -> dict[str, str]:
    from study.launch.scheduler import ACTIVE, slurm_states

    deadline = time.time() + timeout
    while time.time() < deadline:
        states = slurm_states(job_ids)
        if states and not any(s in ACTIVE for s in states.values()):
            return states
        time.sleep(2)
    raise TimeoutError(f"jobs {job_ids} still active: {slurm_states(job_ids)}")


def sacct_state(job_id: str, expect: str, timeout: float = 30) -> str:
    """A plain job's state in SLURM's accounting (`CANCELLED by 0` reads CANCELLED), read until it is `expect` or the
    timeout has passed: sacct lags squeue by a moment."""
    deadline = time.time() + timeout
    while True:
        out = subprocess.run(["sacct", "-n", "-P", "-X", "--format=State", "-j", job_id], capture_output=True,
                             text=True, timeout=30).stdout.split()
        state = out[0] if out else "UNKNOWN"
        if state == expect or time.time() > deadline:
            return state
        time.sleep(0.5)


def slurm_available() -> bool:
    if not os.environ.get("SLURM_CONF"):
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
