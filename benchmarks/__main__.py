"""`python -m benchmarks [--quick] [--only NAME ...] [--threads N] [--gpu [--device cpu --tiny] [--results PATH]]`:
one JSON line per figure on stdout.

Figure modules are imported only when they run: `--gpu` needs torch and this repository (with the two libraries its
configs import, omegaconf and PyYAML): no MLflow, data or transformers. `--gpu` is an acceptance run: it exits 1
when any check fails (benchmarks/acceptance.py) and writes its table into benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
import traceback

from pathlib import Path

from benchmarks.common import default_threads, machine, unavailable

FIGURES = {
    "llama": "benchmarks.llama_bench",
    "hourglass": "benchmarks.hourglass_bench",
    "threads": "benchmarks.threads_bench",
    "malloc": "benchmarks.malloc_bench",
    "plan": "benchmarks.plan_bench",
    "loader": "benchmarks.loader_bench",
    "tracking": "benchmarks.tracking_bench",
    "geometry": "benchmarks.geometry_bench",
    "report": "benchmarks.report_bench",
    "racing": "benchmarks.racing_bench",
    "launch": "benchmarks.launch_bench",
    "ladder": "benchmarks.ladder_bench",
}
"""CPU figures, in the order they run: name for --only -> module with `run(quick) -> list[dict]`."""

GPU_FIGURES = {"gpu": "benchmarks.gpu_bench"}
"""The acceptance run's figures: module with `run(quick, device, tiny) -> list[dict]` (benchmarks.acceptance rows)."""

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds and smaller stores (about 5 min on 2 cores)")
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help=f"run only this figure (repeatable): {', '.join([*FIGURES, *GPU_FIGURES])}")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads on CPU (the CPU figures, a --device cpu run; default 1: on a shared "
                        "machine more threads make timings several times noisier, see the threads figure; 0 keeps "
                        "torch's default)")
    p.add_argument("--gpu", action="store_true",
                   help="the GPU acceptance run (bf16, CUDA; about 10 minutes) instead of the CPU figures")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="with --gpu: cpu runs every part on CPU (fp32, gloo), a dry run of all but the GPU")
    p.add_argument("--tiny", action="store_true", help="with --gpu: a tiny shape instead of 113M and 1B")
    p.add_argument("--results", type=Path, metavar="PATH",
                   help="with --gpu: the file whose acceptance section the run rewrites (default: benchmarks/"
                        "RESULTS.md for a CUDA run at full size; a dry run writes none unless given one)")
    args = p.parse_args(argv)
    if not args.gpu and (args.device != "cuda" or args.tiny or args.results):
        p.error("--device, --tiny and --results go with --gpu")
    known = GPU_FIGURES if args.gpu else FIGURES
    for name in args.only:
        if name not in known:
            p.error(f"unknown figure {name!r}{' with --gpu' if args.gpu else ''}: choose from {', '.join(known)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    figures = GPU_FIGURES if args.gpu else FIGURES
    if not args.gpu or args.device == "cpu":  # a CPU dry run of the acceptance too
        import torch

        default_threads()
        if args.threads > 0:
            torch.set_num_threads(args.threads)
    failed = False
    every: list[dict] = []
    began = time.perf_counter()
    for name, module in figures.items():
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        try:
            figure = importlib.import_module(module)
            rows = (figure.run(args.quick, device=args.device, tiny=args.tiny) if args.gpu else
                    figure.run(args.quick))
        except ModuleNotFoundError as err:
            rows = [unavailable(name, f"{module} cannot be imported: no module named {err.name!r}")]
        except Exception:
            traceback.print_exc()
            rows = [{**unavailable(name, traceback.format_exc(limit=1).strip().splitlines()[-1]), "status": "error"}]
            failed = True
        seconds = round(time.perf_counter() - start, 1)
        for r in rows:
            if "better" not in r and r.get("ratio") is not None:
                r["ratio_is"] = "ours/peer, as the figure's module reports it"
            print(json.dumps(_finite({**r, "figure": name, "figure_seconds": seconds, "machine": machine()})),
                  flush=True)
        every += rows
    if args.gpu:
        failed = _accept(args, every, time.perf_counter() - began) or failed
    return 1 if failed else 0


def _accept(args: argparse.Namespace, rows: list[dict], seconds: float) -> bool:
    """The acceptance run's verdict: its table written where asked, each failed check named on stderr; True when
    any failed (or no GPU was there to run it)."""
    from benchmarks.acceptance import failures, markdown, write_results

    command = "python -m benchmarks " + " ".join(
        ["--gpu", *(["--quick"] if args.quick else []), *([f"--device {args.device}"] if args.device != "cuda" else []),
         *(["--tiny"] if args.tiny else [])])
    path = args.results or (RESULTS if args.device == "cuda" and not args.tiny else None)
    unavailable_here = any(r.get("status") == "unavailable" for r in rows)
    if path and not unavailable_here:
        write_results(path, markdown(rows, machine(), seconds, command))
    bad = failures(rows)
    for r in bad:
        print(f"acceptance: FAILED {r.get('check', r.get('figure'))}: {r['name']}: {r.get('result') or r.get('reason')}"
              f" (criterion: {r.get('criterion', 'the figure runs')})", file=sys.stderr)
    if unavailable_here:
        print("acceptance: not run: " + "; ".join(r["reason"] for r in rows if r.get("status") == "unavailable"),
              file=sys.stderr)
    return bool(bad) or unavailable_here


def _finite(value):
    """JSON has no NaN or infinity: such a value becomes null."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if hasattr(value, "dtype"):  # numpy scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


if __name__ == "__main__":
    sys.exit(main())
