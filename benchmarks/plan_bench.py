"""`study plan hourglass` against counting every planned model by building it on the meta device.

ours: `plan_experiment("hourglass")`, everything the command computes (composition, run keys, budget matching with
closed-form counts) with the per-process caches cleared, as a fresh `study plan` finds them.
peer: for the same planned runs, only the counting, the straightforward way: build each run's model on the meta
device and sum p.numel(). The peer gets the planned shapes for free; it cannot match budgets at all (the matcher
evaluates its count many times per variant). The counts are checked equal.
"""

from __future__ import annotations

from benchmarks.common import interleaved, load_average, median, row

EXPERIMENT = "hourglass"


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
                load_avg=[load, load_average()])]
