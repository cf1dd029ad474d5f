"""`study plan hourglass` against counting every planned model by building it on the meta device.

ours: `plan_experiment("hourglass")`, everything the command computes (composition, run keys, budget matching with
closed-form counts) with the per-process caches cleared, as a fresh `study plan` finds them.
peer: for the same planned runs, only the counting, the straightforward way: build each run's model on the meta
device and sum p.numel(). The peer gets the planned shapes for free; it cannot match budgets at all (the matcher
evaluates its count many times per variant). The counts are checked equal.

Second, the command as a user waits for it: `study plan E` in a fresh process (imports, composition, matching, the
power table and the printed table; no tracking store in its folder) for every shipped experiment, against `study
--help` in a fresh process (the interpreter and the command line's own imports) in the same run.
"""

from __future__ import annotations

from benchmarks.common import interleaved, load_average, median, row

EXPERIMENT = "hourglass"


def command_rows(quick: bool) -> list[dict]:
    """Wall seconds of `study plan E` per shipped experiment against `study --help`, fresh processes."""
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    experiments = sorted(p.stem for p in (root / "sweeps" / "experiment").glob("*.yaml"))
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    folder = tempfile.mkdtemp(prefix="plan-bench-")  # no store here: the plan reads no measured noise

    def command(*argv: str):
        def timed() -> None:
            subprocess.run([sys.executable, "-m", "study.cli", *argv], cwd=folder, env=env, check=True,
                           stdout=subprocess.DEVNULL)
        return timed

    rows = []
    for name in experiments:
        s = interleaved({"ours": command("plan", name), "peer": command("--help")}, 3 if quick else 5, warmup=1)
        rows.append(row(f"study plan {name}, fresh process, vs study --help", median(s["ours"]), median(s["peer"]),
                        "s", "lower", load_avg=load_average()))
    return rows


def run(quick: bool) -> list[dict]:
    from study.config.compose import clear_cache
    from study.models.transformer import build_model
    from study.plan.planner import plan_experiment

    def ours():
        clear_cache()
        return plan_experiment(EXPERIMENT)

    runs = ours().runs
    counts: list[int] = []

    def peer():
        counts[:] = [sum(p.numel() for p in build_model(r.model, "meta").parameters()) for r in runs]

    load = load_average()
    s = interleaved({"ours": ours, "peer": peer}, 3 if quick else 7, warmup=1)
    if counts != [r.params["total"] for r in runs]:
        raise AssertionError("the meta-device counts disagree with the plan's closed-form counts")
    return [row(f"study plan {EXPERIMENT} ({len(runs)} runs, 113M-1B) vs meta-device build + numel of every planned "
                "model (counting only)", median(s["ours"]), median(s["peer"]), "s", "lower", runs=len(runs),
                unique_shapes=len({str(r.model) for r in runs}), counts_agree=True,
                load_avg=[load, load_average()]), *command_rows(quick)]
