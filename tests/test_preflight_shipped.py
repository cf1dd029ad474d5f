"""Every shipped experiment pre-flights at the layout it is meant for: each distinct shape built, sharded and stepped
at its real size on fake tensors (`study preflight`), with torch's FLOPs per token equal to the plan's, no graph break
in torch.compile's trace, and the plan's memory estimate of the step within 10 % of the tracked peak.

Measuring every one takes about 14 CPU minutes, so the results live in `tests/golden/preflight.json`, one entry per
shape as `study preflight` caches it. A shape's name is a digest of what its step depends on: the model, the layout,
torch's version and the code that builds, shards and steps it (study.launch.preflight.shape_of). So an entry is read
only while nothing it was measured with has changed; a change to any of that leaves shapes without an entry, and the
test below names them. Taking new results into the golden file (about 8 minutes on two idle cores) is
`python tests/test_preflight_shipped.py`. The suite measures a few shapes again here, tiny and real, one rank and
eight, and finds the golden entries equal to what this code measures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import ROOT  # noqa: E402

GOLDEN = ROOT / "tests" / "golden" / "preflight.json"
GPU = ["cluster=h100"]
SHIPPED: dict[str, tuple[str, list[str]]] = {
    "demo": ("demo", []),
    "ladder": ("ladder", []),
    "hourglass": ("hourglass", GPU),
    "hourglass_k": ("hourglass_k", GPU),
    "search": ("search", GPU),
    "scaling": ("scaling", GPU),
    "geometry": ("geometry", GPU),
    "widths": ("widths", GPU),
    "release-906M": ("hourglass_release", [*GPU, "--scale", "906M"]),
    "release-3B": ("hourglass_release", [*GPU, "cluster.nodes=4", "--scale", "3B"]),
    "release-8B": ("hourglass_release", [*GPU, "cluster.nodes=8", "--scale", "8B"]),
}
"""Each shipped experiment at the layout it is meant for: the CPU studies on this machine, the GPU studies on one
8-GPU node (`cluster=h100`), the release's sizes on the nodes its file names (1, 4 and 8)."""


WORLD = {"demo": (1, "unsharded"), "ladder": (1, "unsharded"), "release-3B": (32, "hybrid"),
         "release-8B": (64, "hybrid")}
"""Each entry's ranks and sharding where they are not one 8-GPU node's (8, full)."""
TOLERANCE = 0.10
"""How far the plan's estimate of the step measured (`estimated_peak_here_gib`) may sit from the tracked peak."""


def golden() -> dict[str, dict]:
    return json.loads(GOLDEN.read_text())


@pytest.fixture
def golden_cache(workdir, tmp_path, monkeypatch):
    """A cache holding the golden results, and a `measure` that fails naming what is missing: nothing is measured."""
    folder = tmp_path / "cache" / "preflight"
    folder.mkdir(parents=True)
    for digest, entry in golden().items():
        (folder / f"{digest}.json").write_text(json.dumps(entry))
    monkeypatch.setenv("STUDY_CACHE", str(tmp_path / "cache"))

    def missing(spec, trace=True):
        pytest.fail(f"run {spec.name}'s shape has no result in {GOLDEN.relative_to(ROOT)} (its model, layout, torch "
                    "or the code that steps it changed): take new results with `python tests/test_preflight_shipped.py`"
                    " and commit the file", pytrace=False)

    monkeypatch.setattr("study.train.preflight.measure", missing)


def preflown(name: str, capsys) -> dict:
    from study.cli import main

    experiment, args = SHIPPED[name]
    capsys.readouterr()
    assert main(["preflight", experiment, *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shape_of_a_shipped_experiment_steps_counts_its_flops_traces_whole_and_meets_its_estimate(
        name, golden_cache, capsys):
    shapes = preflown(name, capsys)["shapes"]
    assert shapes and all(s["cached"] for s in shapes)
    for s in shapes:
        where = f"{name} shape {s['shape']} ({s['names'][0]}, {s['layout']})"
        assert s["flops_per_token"] == s["plan_flops_per_token"], where
        assert (s["graph_breaks"], s["break_reasons"]) == (0, []), where
        assert abs(s["estimated_peak_here_gib"] / s["peak_gib"] - 1) <= TOLERANCE, where
        assert (s["world_size"], s["layout"].split(", ")[-1]) == WORLD.get(name, (8, "full")), where


def shapes_of(name: str):
    from study.cli import HANDLERS, _filtered
    from study.launch.preflight import distinct_shapes
    from study.parser import build_parser

    experiment, args = SHIPPED[name]
    # the runs `study preflight` selects from these arguments, read by its own parser and filter
    return distinct_shapes(_filtered(build_parser(HANDLERS).parse_args(["preflight", experiment, *args])).runs)[0]


def test_the_golden_file_holds_the_shipped_shapes_and_nothing_else(workdir, tmp_path, monkeypatch):
    monkeypatch.setenv("STUDY_CACHE", str(tmp_path / "cache"))
    assert set(golden()) == {shape.digest for name in SHIPPED for shape in shapes_of(name)}


def remeasured(name: str, pick) -> None:
    """Measure again the shape of `name` that `pick` chooses from its golden entries and find it equal to its entry
    (all but the seconds it took: fake tensors count bytes and FLOPs exactly)."""
    from study.train.preflight import measure

    shapes = {shape.digest: shape for shape in shapes_of(name)}
    entries = {d: e["measured"] for d, e in golden().items() if d in shapes}
    digest = pick(entries)
    measured = asdict(measure(shapes[digest].spec))
    assert {**measured, "seconds": None} == {**entries[digest], "seconds": None}, digest


@pytest.mark.parametrize("name", ["demo", "ladder"])
def test_the_golden_results_of_tiny_shapes_are_what_this_code_measures(name, workdir, tmp_path, monkeypatch):
    monkeypatch.setenv("STUDY_CACHE", str(tmp_path / "cache"))
    remeasured(name, lambda entries: max(entries, key=lambda d: entries[d]["peak_gib"]))


@pytest.mark.integration
def test_the_golden_results_of_a_real_size_eight_rank_shape_are_what_this_code_measures(workdir, tmp_path,
                                                                                        monkeypatch):
    """The 113M shape (one 8-GPU node, FSDP2) that steps fastest: seconds, against the minutes of every shape."""
    monkeypatch.setenv("STUDY_CACHE", str(tmp_path / "cache"))
    remeasured("hourglass", lambda entries: min(entries, key=lambda d: sum(entries[d]["seconds"].values())))


def refresh() -> None:
    """Pre-flight every entry of SHIPPED in a fresh cache, two at a time, and write what was measured to GOLDEN."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "STUDY_CACHE": cache}

        def run(name: str) -> None:
            experiment, args = SHIPPED[name]
            code = f"import sys; from study.cli import main; sys.exit(main({['preflight', experiment, *args]!r}))"
            subprocess.run([sys.executable, "-c", code], env=env, check=True, stdout=subprocess.DEVNULL)
            print(f"{name}: pre-flown", file=sys.stderr)

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(run, SHIPPED))
        entries = {p.stem: json.loads(p.read_text()) for p in sorted((Path(cache) / "preflight").glob("*.json"))}
    GOLDEN.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    refresh()
