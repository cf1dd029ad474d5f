"""The report's racing section: at which branch point each arm stopped, on which interval, and the GPU-hours that saved,
from the race's record (the experiment's MLflow ``racing`` run, :func:`analysis.racing.race_record`).
"""

from __future__ import annotations

from analysis.racing import RACE_ARTIFACT, RACE_ARTIFACT_BEFORE
from analysis.records import latest_record
from analysis.render import Block, Heading, Paragraph, Table, number
from study.schema import ROLE_RACING


def read_race(client, experiment_id: str) -> dict | None:
    """The race's record (under its old name in older stores); None when the experiment never raced."""
    for artifact in (RACE_ARTIFACT, RACE_ARTIFACT_BEFORE):
        record = latest_record(client, experiment_id, ROLE_RACING, artifact)
        if record is not None:
            return record
    return None


def race_blocks(record: dict | None, metric: str) -> list[Block]:
    """The section: one sentence on what stopped, the stops, then every rung's verdicts."""
    if not record:
        return []
    stops = record.get("stops") or []
    verdicts = [v for v in record.get("verdicts") or [] if v.get("variant")]
    saved = sum(s.get("gpu_hours_saved") or 0.0 for s in stops)
    points = ", ".join(f"{a:g}" for a in record.get("at") or [])
    rule = ("worse than the baseline, or equivalent to it," if record.get("stop_equivalent") else
            "worse than the baseline")
    blocks: list[Block] = [
        Heading("Racing"),
        Paragraph(f"Arms were raced at the branch points {points} (fractions of the planned tokens): at each, the "
                  f"branch endpoints' paired deltas on {metric} against {record.get('baseline')} were decided at that "
                  "point's share of alpha (spent across the points, Holm over the arms still racing), and an arm "
                  f"decided {rule} stopped training there. The interval shown is the paired t interval at the "
                  "point's alpha, unadjusted for Holm: it can exclude 0 for an arm Holm left undecided, and the "
                  "verdict follows Holm. "
                  # CPU-sized plans price their runs in thousandths of a GPU-hour: three significant digits
                  + (f"{len(stops)} arm(s) stopped, saving about {saved:,.3g} GPU-hours." if stops else
                     "No arm stopped: every arm trained to its last branch.")),
    ]
    if stops:
        blocks.append(Table(["variant", "scale", "stopped at", *_SHARED, "GPU-h saved"],
                            [[s["variant"], s["scale"], f"{s['at']:g}", *_shared(s),
                              number(s.get("gpu_hours_saved"), ",.3g")] for s in stops]))
    if verdicts:
        blocks.append(Table(["branch point", "variant", "scale", *_SHARED, "stops"],
                            [[f"{v['at']:g}", v["variant"], v["scale"], *_shared(v), "yes" if v["stops"] else ""]
                             for v in verdicts]))
    return blocks


_SHARED = ("verdict", "pairs", "Δ", "t interval (unadjusted)", "alpha")
"""The columns both tables hold; what the race records is the t interval at the point's alpha, before Holm over the
arms."""


def _shared(row: dict) -> list[str]:
    """A stop's or a verdict's cells under :data:`_SHARED`."""
    return [row["verdict"], str(row["n"]), number(row["mean_delta"], "+.4g"),
            f"[{number(row['ci_low'], '+.4g')}, {number(row['ci_high'], '+.4g')}]", f"{row['alpha']:.3g}"]
