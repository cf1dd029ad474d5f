"""`python -m benchmarks [--quick] [--only NAME ...] [--threads N] [--gpu]`: one JSON line per figure on stdout.

Figure modules are imported only when they run: `--gpu` needs nothing but torch and this repository.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
import traceback

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
}
"""CPU figures, in the order they run: name for --only -> module with `run(quick) -> list[dict]`."""

GPU_FIGURES = {"gpu": "benchmarks.gpu_bench"}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds and smaller stores (about 5 min on 2 cores)")
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help=f"run only this figure (repeatable): {', '.join([*FIGURES, *GPU_FIGURES])}")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads for the CPU figures (default 1: on a shared machine more threads make "
                        "timings several times noisier, see the threads figure; 0 keeps torch's default)")
    p.add_argument("--gpu", action="store_true", help="the GPU figures (bf16, CUDA) instead of the CPU ones")
    args = p.parse_args(argv)
    known = GPU_FIGURES if args.gpu else FIGURES
    for name in args.only:
        if name not in known:
            p.error(f"unknown figure {name!r}{' with --gpu' if args.gpu else ''}: choose from {', '.join(known)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    figures = GPU_FIGURES if args.gpu else FIGURES
    if not args.gpu:
        import torch

        default_threads()
        if args.threads > 0:
            torch.set_num_threads(args.threads)
    failed = False
    for name, module in figures.items():
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        try:
            rows = importlib.import_module(module).run(args.quick)
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
    return 1 if failed else 0


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
