"""The headline of a report on the console: one row per decision, then what the decisions rest on (the LR they were
trained at, their worth in compute)."""

from __future__ import annotations

from analysis.compute import RANGE
from analysis.power import seeds_phrase


def print_headline(result: dict) -> None:
    """The report's decision table on the console (`study report`, `study demo`), with report.md's adjusted interval
    and seeds phrase, then each variant's effective compute and every verdict that flips with the tuned LR."""
    from study.console import console
    from rich.table import Table

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    table = Table(title=f"{result['experiment']}: decisions vs {result['baseline']}"
                  + (f" ({result['sequential']})" if result.get("sequential") else ""))
    for col in ("scale", "variant", "metric", "n", "mean delta", "adjusted t CI", "adjusted p", "verdict",
                "seeds to decide"):
        table.add_column(col)
    for d in result["decisions"]:
        table.add_row(d["scale"], d["variant"], d["metric"], str(d["n"]), num(d["mean_delta"], "+.4f"),
                      f"[{num(d['adj_ci_low'], '+.4f')}, {num(d['adj_ci_high'], '+.4f')}]", num(d["p_adjusted"], ".3f"),
                      d["verdict"], seeds_phrase(d["seeds_to_decide"], d["n"]) if d["seeds_to_decide"] else "-")
    out = console()
    out.print(table)
    tuning = result.get("tuning") or {}
    if tuning.get("decided_on") == "tune":
        out.print("decided on the tuned runs (each variant at its own tuned LR)")
    for p in tuning.get("shared_vs_tuned", []):
        if p["flip"]:
            out.print(f"flip: {p['variant']} at {p['scale']} on {p['metric']}: {p['shared_verdict']} at the shared LR, "
                      f"{p['tuned_verdict']} tuned")
    # JSON has no infinity: a bound the baseline never reaches is None there
    for r in (result.get("effective_compute") or {}).get("rows", []):
        if r["fitted_range"]:
            what = f"range, {r['seeds']} seeds" if r["interval"] == RANGE else "95% CI"
            out.print(f"{r['variant']}: {num(r['multiplier'], '.2f')}x compute [{num(r['ci_low'], '.2f')}, "
                      f"{num(r['ci_high'], '.2f')}] ({what}) over {r['scale']}")
