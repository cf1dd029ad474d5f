"""What `python -m benchmarks --gpu` passes or fails on, and its record in RESULTS.md.

Stdlib only: the verdicts and the writer are checked on CPU (tests/test_benchmarks.py), where no GPU ever is.
Every check is a row (benchmarks.common.row) with `check`, `verdict` (`pass`, `fail` or `info`: measured, judged by
nothing), `criterion` (the rule, in words), and `result`/`against` (what the RESULTS.md table shows).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

MEMORY_TOLERANCE = 0.10
"""How far a step's measured peak may lie from study.plan.memory's estimate of it (either way, eager)."""
LOSS_STEPS = 50
"""Steps of the bf16 run and of the fp32 run whose losses are compared."""
LOSS_TOLERANCE = 0.02
"""How far bf16's mean loss over the last LOSS_WINDOW steps may lie from fp32's, relative."""
LOSS_WINDOW = 10
"""Steps at the end of both runs whose losses are averaged."""
SAME_TOLERANCE = 1e-5
"""How far FSDP2 over a one-rank process group may move an fp32 loss from the plain step's, relative: the
project's cross-layout tolerance (fp32 round-off of another reduction order)."""
RESUME_TOLERANCE = 1e-4
"""How far a resumed step's loss may lie from the uninterrupted run's, relative. Equal is what a CPU gives; a GPU's
attention backward adds in another order from run to run."""

START = "<!-- gpu-acceptance: `python -m benchmarks --gpu` writes between these lines -->"
END = "<!-- /gpu-acceptance -->"


def check(name: str, check: str, verdict: str, criterion: str, result: str, against: str = "", **extra) -> dict:
    """One acceptance row: `name` says what ran, `check` which kind (throughput, memory, bf16 vs fp32, nccl,
    resume, step), `verdict` pass/fail/info."""
    from benchmarks.common import row

    if verdict not in ("pass", "fail", "info"):
        raise ValueError(f"verdict={verdict!r}: use pass, fail or info")
    base = row(name, extra.pop("ours", None), extra.pop("peer", None), extra.pop("units", None),
               extra.pop("better", "higher"), **extra)
    return {**base, "check": check, "verdict": verdict, "criterion": criterion, "result": result,
            "against": against}


def failed_step(name: str, what: str, err: BaseException, **extra) -> dict:
    """The row of a step that raised: its check fails, naming the error; the other checks still run."""
    return check(name, what, "fail", "the step runs", f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                 if str(err) else type(err).__name__, **extra)


def memory_verdict(measured: int, estimated: int, compiled: bool) -> tuple[str, str]:
    """(verdict, criterion) of a measured peak against the estimate. Eager is what study.plan.memory models: within
    MEMORY_TOLERANCE either way. A compiled step keeps less than eager (fused kernels save fewer tensors), which the
    estimate does not model: it passes at or below the estimate plus the tolerance."""
    high = measured <= estimated * (1 + MEMORY_TOLERANCE)
    if compiled:
        return ("pass" if high else "fail",
                f"compiled: measured <= estimate x {1 + MEMORY_TOLERANCE:g} (the estimate models eager mode)")
    return ("pass" if high and measured >= estimated * (1 - MEMORY_TOLERANCE) else "fail",
            f"eager: measured within {MEMORY_TOLERANCE:.0%} of study.plan.memory's estimate")


def loss_verdict(bf16: list[float], fp32: list[float]) -> tuple[str, str, float]:
    """(verdict, criterion, relative difference) of bf16's losses against fp32's over the same batches: every loss
    finite, both runs LOSS_STEPS long, and the means of their last LOSS_WINDOW losses within LOSS_TOLERANCE."""
    criterion = (f"{LOSS_STEPS} steps each, every loss finite, mean of the last {LOSS_WINDOW} within "
                 f"{LOSS_TOLERANCE:.0%} of fp32's")
    if len(bf16) != LOSS_STEPS or len(fp32) != LOSS_STEPS or not all(map(math.isfinite, [*bf16, *fp32])):
        return "fail", criterion, math.inf
    a, b = sum(bf16[-LOSS_WINDOW:]) / LOSS_WINDOW, sum(fp32[-LOSS_WINDOW:]) / LOSS_WINDOW
    return ("pass" if abs(a - b) <= LOSS_TOLERANCE * abs(b) else "fail"), criterion, abs(a / b - 1)


def same_verdict(got: list[float], want: list[float], tolerance: float) -> tuple[str, float]:
    """(verdict, largest relative difference) of two runs' losses step by step: as many, finite, within
    `tolerance`."""
    if len(got) != len(want) or not got or not all(map(math.isfinite, [*got, *want])):
        return "fail", math.inf
    diff = max(abs(g / w - 1) for g, w in zip(got, want, strict=True))
    return ("pass" if diff <= tolerance else "fail"), diff


def failures(rows: list[dict]) -> list[dict]:
    """The rows that fail the acceptance (a check's verdict, or a figure that raised)."""
    return [r for r in rows if r.get("verdict") == "fail" or r.get("status") == "error"]


def markdown(rows: list[dict], machine: dict, seconds: float, command: str) -> str:
    """The acceptance run as RESULTS.md shows it: when, where, the overall verdict, one table row per check."""
    bad = failures(rows)
    judged = [r for r in rows if r.get("verdict") != "info"]
    where = ", ".join(str(machine[k]) for k in ("gpu", "cuda", "torch") if machine.get(k)) or machine.get("device")
    head = [f"`{command}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {seconds / 60:.1f} min, on {where}:",
            f"**FAILED**: {len(bad)} of {len(judged)} checks." if bad else
            f"**passed**: all {len(judged)} checks ({len(rows) - len(judged)} more rows are measurements only).",
            "",
            "| check | what | result | against | verdict | criterion |", "|---|---|---|---|---|---|"]

    def cell(text) -> str:
        return str(text or "").replace("|", "\\|").replace("\n", " ")

    body = [f"| {cell(r.get('check'))} | {cell(r.get('name'))} | {cell(r.get('result'))} | {cell(r.get('against'))} "
            f"| {cell(r.get('verdict') or r.get('status'))} | {cell(r.get('criterion') or r.get('reason'))} |"
            for r in rows]
    return "\n".join(head + body)


def write_results(path: Path, text: str) -> None:
    """Put `text` between RESULTS.md's acceptance markers, replacing what a previous run wrote there (the rest of the
    file as it is); a file without them gets them, and the text, at its end."""
    old = path.read_text() if path.exists() else ""
    block = f"{START}\n{text}\n{END}"
    if START in old and END in old.split(START, 1)[1]:
        before, rest = old.split(START, 1)
        new = before + block + rest.split(END, 1)[1]
    else:
        new = old + ("\n" if old and not old.endswith("\n") else "") + block + "\n"
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(new)
    tmp.replace(path)
