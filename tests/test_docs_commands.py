"""The commands cannot go stale: every command of a shell block (```bash, ```sh, ```shell, ```console) in the README
and the guides in docs/ runs as a new user types it, from a fresh folder outside the checkout with the venv's
`study` and `python` first on PATH and STUDY_CACHE the shared data cache, or, where it would train, submit or take
minutes, through the plan of the same experiment and overrides, so that every experiment name, override and flag
the docs quote goes through the real parser and composer.

WAYS maps each command's pattern to how it runs:

- in full: `study plan ...` and `study launch ... --dry-run` (a second each, nothing trained or submitted), and the
  lm-eval block of docs/USAGE.md (`python -m study.eval ...`, `lm_eval ...`) on a 6-step tiny run this
  module trains, its key for KEY (20 documents);
- by its plan: `study demo` (6 minutes of training) as the two steps it takes before training, `study plan demo
  cluster=local` and `study launch demo cluster=local --dry-run`, against the runs the README says it trains; a
  `study launch` that submits (SLURM, or local training) as its dry run with the same overrides;
- as files: `scripts/setup` and `scripts/test` (a venv install, then SLURM, an MLflow server and the whole suite:
  minutes): each exists, is executable, parses (`bash -n`) and handles every flag the docs give it.

A fenced block without a language, in a language WAYS does not know, or holding a command no pattern of WAYS
matches fails test_every_command_block_is_one_the_test_knows_how_to_run, so nothing is skipped unseen.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT, TINY

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
NOT_COMMANDS = {"text", "python", "yaml", "json", "toml"}
"""Fenced blocks that hold no commands: diagrams, code, config files."""
VENV_BIN = ROOT / ".venv" / "bin"
DEMO_ARMS = {"conventional", "hourglass", "tapered"}


@dataclass(frozen=True)
class Command:
    where: str
    """The document and line of its block (`docs/CLUSTER.md:30`)."""
    text: str
    """One command: continuation lines joined, the comment and a `$ ` prompt dropped, whitespace runs as one space."""
    block: tuple[str, ...]
    """Every command of its block, in order: an assignment runs before the commands after it."""

    @property
    def args(self) -> list[str]:
        return shlex.split(self.text)


def fenced_blocks() -> list[tuple[str, str, str]]:
    """Every fenced block of the README and the guides: where it starts, its language, its text."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for block in re.finditer(r"(?ms)^[ \t]*```(\S*)[^\n]*\n(.*?)^[ \t]*```", text):
            where = f"{doc.relative_to(ROOT)}:{text[:block.start()].count(chr(10)) + 1}"
            found.append((where, block.group(1), textwrap.dedent(block.group(2))))
    return found


def documented_commands() -> list[Command]:
    commands = []
    for where, language, body in fenced_blocks():
        if language not in SHELL:
            continue
        texts = []
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#\s.*$", "", line.removeprefix("$ "))
            texts += [" ".join(part.split()) for part in line.split("&&") if part.strip()]
        commands += [Command(where, text, tuple(texts)) for text in texts]
    return commands


@dataclass
class Done:
    rc: int
    out: str
    err: str
    folder: Path


class User:
    """A new user's shell: each command in a fresh folder of its own (or the one it is given), the venv first on
    PATH, no tracking URI set; what a command printed is kept, so a command two checks share runs once."""

    def __init__(self, tmp_path_factory, request, done: dict[tuple[str, Path | None], Done]):
        self.tmp = tmp_path_factory
        self.request = request
        self.env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}
        self.env.pop("MLFLOW_TRACKING_URI", None)
        self.done = done

    def run(self, script: str, folder: Path | None = None) -> Done:
        if (script, folder) not in self.done:
            cwd = folder or self.tmp.mktemp("user")
            ran = subprocess.run(["bash", "-ec", script], cwd=cwd, env=self.env, capture_output=True, text=True,
                                 timeout=300)
            self.done[script, folder] = Done(ran.returncode, ran.stdout, ran.stderr, cwd)
        return self.done[script, folder]

    def planned_runs(self, experiment: str, args: list[str]) -> list[dict]:
        """The runs `study plan EXPERIMENT ARGS --json` plans."""
        done = self.run(shlex.join(["study", "plan", experiment, *args, "--json"]))
        assert done.rc == 0, done.err[-3000:]
        return json.loads(done.out)["runs"]

    def trained_run(self) -> tuple[str, Path]:
        return self.request.getfixturevalue("trained_run")


def overrides(args: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in args if "=" in a and not a.startswith("-"))


def run_plan(command: Command, user: User) -> None:
    """In full, and again with --json: each run it plans is a line of its table, `--scale/--variant/--seed` select
    those runs only, and `cluster.nodes=N` lays every run on N nodes."""
    done = user.run(command.text)
    assert done.rc == 0, done.err[-3000:]
    experiment, *rest = command.args[2:]
    runs = user.planned_runs(experiment, rest)
    assert runs and [r["run_key"] for r in runs if r["run_key"] not in done.out] == []
    for flag in ("scale", "variant", "seed"):
        chosen = {b for a, b in zip(rest, rest[1:]) if a == f"--{flag}"}
        assert not chosen or {str(r[flag]) for r in runs} <= chosen
    if "cluster.nodes" in overrides(rest):
        assert {r["nodes"] for r in runs} == {int(overrides(rest)["cluster.nodes"])}


def run_dry_launch(command: Command, user: User) -> None:
    """In full: it lists every run the plan of the same overrides has and writes nothing (arrays and sbatch scripts
    only); on SLURM each job's script asks for the nodes `cluster.nodes` gives."""
    done = user.run(command.text)
    assert done.rc == 0, done.err[-3000:]
    assert list(done.folder.iterdir()) == [], "a dry run wrote into the working directory"
    experiment = command.args[2]
    given = [a for a in command.args[3:] if not a.startswith("--")]
    assert [r["run_key"] for r in user.planned_runs(experiment, given) if r["run_key"] not in done.out] == []
    cluster = overrides(given)
    if cluster.get("cluster", "local") != "local" and "cluster.nodes" in cluster:
        assert f"#SBATCH --nodes={cluster['cluster.nodes']}" in done.out


def launch_by_its_dry_run(command: Command, user: User) -> None:
    """By its dry run: the same experiment and overrides, with `--dry-run`, and every flag it gives in `study launch
    -h` (a real launch submits jobs or trains for minutes)."""
    usage = user.run("study launch -h")
    assert [a for a in command.args if a.startswith("--") and a not in usage.out] == []
    run_dry_launch(Command(command.where, f"{command.text} --dry-run", command.block), user)


def demo_by_its_plan(command: Command, user: User) -> None:
    """By its plan: `study demo` plans and launches the experiment with `cluster=local` (then trains for minutes),
    so its plan and dry run; `demo`'s runs are those the README names: each arm's 3 tune runs at x0.5, x1 and x2
    of the LR (seed 0) and its 3 seeds."""
    assert os.access(ROOT / command.args[0], os.X_OK), f"{command.args[0]} is made by scripts/setup"
    experiment = "ladder" if "--ladder" in command.args else "demo"
    run_plan(Command(command.where, f"study plan {experiment} cluster=local", command.block), user)
    run_dry_launch(Command(command.where, f"study launch {experiment} cluster=local --dry-run", command.block), user)
    if experiment == "demo":
        runs = user.planned_runs("demo", ["cluster=local"])
        assert Counter((r["role"], r["variant"]) for r in runs) == {
            (role, arm): 3 for role in ("tune", "train") for arm in DEMO_ARMS}
        tune = [r for r in runs if r["role"] == "tune"]
        assert {r["name"].rsplit("-lr", 1)[1] for r in tune} == {"0.5", "1", "2"} and {r["seed"] for r in tune} == {0}
        assert {r["seed"] for r in runs if r["role"] == "train"} == {0, 1, 2} and {r["scale"] for r in runs} == {"tiny"}


def script_by_its_file(command: Command, user: User) -> None:
    """As a file: it exists, is executable and parses, and names every flag the docs give it."""
    path = ROOT / command.args[0]
    assert path.is_file() and os.access(path, os.X_OK), path
    parsed = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr
    assert [f for f in command.args[1:] if f.startswith("--") and f not in path.read_text()] == []


def lm_eval_on_a_trained_run(command: Command, user: User) -> None:
    """In full, in the folder a tiny run trained in, KEY its key: lm-eval's results
    table scores `arc_easy_local`. `lm_eval ...` stands for the same arguments; on the lm-eval release the guide says
    is installed, that reads no plugins, the error it ends on is the refusal the guide quotes (0.4.13 raises "Unknown
    model" first, inside the traceback, then "no model for this name found")."""
    key, folder = user.trained_run()
    text = command.text
    if text.endswith("--model_args ..."):
        (full,) = [t for t in command.block if t.startswith("python -m study.eval ")]
        text = text.removesuffix("...") + full.split("--model_args ", 1)[1]
        from study.config.tasks import LOCAL_TASK_DIR

        text += f" --include_path {LOCAL_TASK_DIR}"  # the guide: `lm_eval` itself needs the shipped tasks named
    done = user.run(text.replace("run=KEY", f"run={key}"), folder)
    if text.startswith("lm_eval "):
        from importlib.metadata import version

        guide = " ".join((ROOT / "docs" / "USAGE.md").read_text().split())
        release, refusal = re.search(r"so (\S+) \(the one installed here\) answers \"(.*?)\"", guide).groups()
        assert version("lm_eval") == release, "docs/USAGE.md names another lm-eval release than the one installed"
        assert done.rc != 0 and refusal in done.err.strip().splitlines()[-1], done.err[-3000:]
        return
    assert done.rc == 0, done.err[-3000:]
    assert re.search(r"^\|\s*arc_easy_local\s*\|.*\|\s*acc\s*\|", done.out, re.M), done.out[-3000:]


WAYS = [
    (r"scripts/(setup|test)( --[\w-]+)*", script_by_its_file),
    (r"\.venv/bin/study demo( --ladder)?", demo_by_its_plan),
    (r"study plan \S+( .*)?", run_plan),
    (r"study launch \S+ (.* )?--dry-run( .*)?", run_dry_launch),
    (r"study launch (?!.*--dry-run)\S+( .*)?", launch_by_its_dry_run),
    (r"python -m study\.eval .*", lm_eval_on_a_trained_run),
    (r"lm_eval --model study --model_args \.\.\.", lm_eval_on_a_trained_run),
]
"""Each documented command's pattern (the whole command matches) and how it runs."""

COMMANDS = documented_commands()


def ways_of(command: Command) -> list:
    return [way for pattern, way in WAYS if re.fullmatch(pattern, command.text)]


def test_every_command_block_is_one_the_test_knows_how_to_run():
    assert [where for where, language, _ in fenced_blocks() if language not in SHELL | NOT_COMMANDS] == [], (
        "give each fenced block a language: ```bash for commands, ```text for a diagram")
    unknown = [f"{c.where}: {c.text} ({len(ways_of(c))} ways)" for c in COMMANDS if len(ways_of(c)) != 1]
    assert unknown == [], "add each command to WAYS with how it runs (or checks) it"
    assert [p for p, _ in WAYS if not any(re.fullmatch(p, c.text) for c in COMMANDS)] == [], "a way no doc uses"


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, data_cache, empty_store) -> tuple[str, Path]:
    """A user's folder holding one trained tiny run (6 steps) and its MLflow store: its key and the folder."""
    from study.plan.planner import select_run
    from study.train.loop import train

    folder = tmp_path_factory.mktemp("trained")
    shutil.copyfile(empty_store, folder / "mlflow.db")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        spec = select_run([*TINY, "experiment=docs", "train.max_steps=6", "model.max_seq_len=128"])
        assert train(spec).status == "FINISHED"
    return spec.key, folder


@pytest.fixture(scope="module")
def printed(data_cache) -> dict:
    """What the commands printed, shared by this module's tests: a command two checks share runs once."""
    return {}


@pytest.mark.integration
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.where} {c.text[:70]}")
def test_the_documented_command_runs_as_documented(command, printed, tmp_path_factory, request):
    (way,) = ways_of(command)
    way(command, User(tmp_path_factory, request, printed))


def test_the_ladders_minutes_are_the_latest_measured(capsys):
    """The README and docs/USAGE.md quote the ladder's wall time from benchmarks/RESULTS.md's latest ladder run, and
    `study demo -h` rounds it."""
    from study.cli import main

    results = (ROOT / "benchmarks" / "RESULTS.md").read_text().split("\n## The ladder", 1)[1]
    measured = re.search(r"^\| [^|]+ \| \*\*([\d.]+) min\*\*", results, re.M).group(1)
    for doc in (ROOT / "README.md", ROOT / "docs" / "USAGE.md"):
        assert f"{measured} minutes" in " ".join(doc.read_text().split()), f"{doc.name}: not RESULTS.md's {measured}"
    with pytest.raises(SystemExit):
        main(["demo", "-h"])
    assert f"about {round(float(measured))} minutes" in " ".join(capsys.readouterr().out.split())
