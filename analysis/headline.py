"""The headline of a report on the console: one row per decision."""

from __future__ import annotations


def print_headline(result: dict) -> None:
    """The report's decision table on the console (`study report`, `study demo`)."""
    from study.term import console
    from rich.table import Table

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    table = Table(title=f"{result['experiment']}: decisions vs {result['baseline']}"
                  + (f" ({result['sequential']})" if result.get("sequential") else ""))
    for col in ("scale", "variant", "metric", "n", "mean delta", "t CI", "adjusted p", "verdict", "seeds to decide"):
        table.add_column(col)
    for d in result["decisions"]:
        table.add_row(d["scale"], d["variant"], d["metric"], str(d["n"]), num(d["mean_delta"], "+.4f"),
                      f"[{num(d['ci_low'], '+.4f')}, {num(d['ci_high'], '+.4f')}]", num(d["p_adjusted"], ".3f"),
                      d["verdict"], str(d["seeds_to_decide"] or "-"))
    console().print(table)
