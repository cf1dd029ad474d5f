"""Shared fixtures: an isolated working directory, MLflow store and data cache per test session."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Four test workers share two cores: one OpenMP thread each. Each worker's own pool of two would spin-wait against
# the others' (measured: a quarter more CPU for the same tests). Set before anything imports torch; the processes the
# tests start inherit it, and launched jobs size their pools from `cluster.cpus_per_task` as on a cluster.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# pytest-xdist's workers start with COLUMNS=80 while a plain pytest run has none: a command's output would wrap in
# one and not the other. Every test sees what a pipe sees; a test about widths sets COLUMNS itself.
os.environ.pop("COLUMNS", None)


USER_STATE = ("runs", "mlflow.db", "mlruns", "mlartifacts", "reports", "outputs", "multirun")
"""What a user's own commands (`study demo`, `study launch`, `study report`) leave in the checkout: no test reads or
writes it. The README's two commands run in order (the demo, then the tests), so the tests meet a checkout the demo
has filled."""


def _user_state() -> dict[str, tuple[int, int]]:
    """Every file and folder of USER_STATE in the checkout, with its size and modification time."""
    state = {}
    for name in USER_STATE:
        top = ROOT / name
        if not top.exists():
            continue
        paths = [top] if top.is_file() else [top, *top.rglob("*")]
        for path in paths:
            try:
                info = path.lstat()
            except FileNotFoundError:  # a file the demo's own processes remove as the walk passes
                continue
            state[str(path.relative_to(ROOT))] = (info.st_size if path.is_file() else 0, info.st_mtime_ns)
    return state


@pytest.fixture(scope="session", autouse=True)
def outside_the_checkout(tmp_path_factory):
    """Every test starts in a scratch folder of its own session, never in the checkout: a plan there would read the
    demo's tuning records from `runs/_tune/`, a report its `mlflow.db`. At the end of the session the checkout's user
    state is what it was at the start."""
    before = _user_state()
    scratch = tmp_path_factory.mktemp("cwd")
    start = os.getcwd()
    os.chdir(scratch)
    yield scratch
    os.chdir(start)
    after = _user_state()
    changed = sorted(set(before.items()) ^ set(after.items()))
    assert not changed, f"tests changed the checkout's own runs, store or reports: {[p for p, _ in changed][:10]}"


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One data cache for the session: the docstring corpus, BPE and shards are built once."""
    path = Path(os.environ.get("STUDY_TEST_CACHE") or tmp_path_factory.mktemp("cache"))
    os.environ["STUDY_CACHE"] = str(path)
    return path


_EMPTY: list[Path] = []


def _empty_template() -> Path:
    """This worker's MLflow SQLite store with its tables made and nothing in it, made on first use."""
    if not _EMPTY:
        import atexit
        import tempfile

        from mlflow import MlflowClient

        folder = Path(tempfile.mkdtemp(prefix="study-empty-store-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        MlflowClient(f"sqlite:///{folder / 'mlflow.db'}").search_experiments()
        _EMPTY.append(folder / "mlflow.db")
    return _EMPTY[0]


def new_store(path: Path) -> str:
    """The URI of a new, empty SQLite MLflow store at `path`: a copy of one with its tables made. MLflow makes them with
    its schema migrations the first time a process opens a new store (1-1.5 s of CPU, in whichever process opens it
    first: the test's, a job's). A test about creating a store itself opens a path that does not exist instead."""
    assert not path.exists(), f"{path} already holds a store"
    shutil.copyfile(_empty_template(), path)
    return f"sqlite:///{path}"


@pytest.fixture(scope="session")
def empty_store() -> Path:
    """An MLflow SQLite store with its tables made and nothing in it: a working directory starts from a copy."""
    return _empty_template()


@pytest.fixture
def workdir(tmp_path, monkeypatch, data_cache, request) -> Path:
    """A fresh working directory with its own SQLite MLflow store `mlflow.db`, empty (unless a server URI is set by
    the test); with the marker `no_store`, without one."""
    if not request.node.get_closest_marker("no_store"):
        shutil.copyfile(request.getfixturevalue("empty_store"), tmp_path / "mlflow.db")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


TRAINING_RUNS = "tags.`study.run_key` LIKE '%'"
"""MLflow filter for training runs only: parent (per variant and scale), report and sequential runs carry no key."""

# Small, fast runs: tiny model, 2 layers, short sequences, a capped corpus.
TINY = ["scale=tiny", "model.n_layers=2", "model.d_model=64", "model.n_heads=2", "model.ffn.width=128",
        "model.max_seq_len=32", "data.seq_len=32", "data.max_docs=1500", "data.vocab_size=512",
        "model.vocab_size=512", "data.val_fraction=0.05", "train.micro_batch=4", "train.val_batches=2",
        "train.warmup_steps=2", "budget.tolerance=1e-2"]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tests that share a module fixture run on one xdist worker (each worker would otherwise build the fixture
    again: a module-scoped fixture lives per process), unless they already name a group. A test that only reads what
    a module fixture trained is an integration test too: the quick tier would otherwise train that fixture for it.
    Such fixtures are the module-scoped ones an `integration` test uses."""
    heavy = set()
    for item in items:
        shared = [name for name in item.fixturenames if _module_scoped(item, name)]
        if shared and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
        if item.get_closest_marker("integration"):
            heavy.update((item.module.__name__, name) for name in shared)
    for item in items:
        if not item.get_closest_marker("integration") and any(
                (item.module.__name__, name) in heavy for name in item.fixturenames):
            item.add_marker(pytest.mark.integration)


def _module_scoped(item, name: str) -> bool:
    """The fixture `name` the test uses is one of its module's (or a conftest's) module-scoped fixtures."""
    defs = item._fixtureinfo.name2fixturedefs.get(name)
    return bool(defs) and defs[-1].scope == "module"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With STUDY_TEST_CPU=<file>, one JSON line per test: the CPU seconds its worker spent on it (setup, call and
    teardown) and those of the child processes it reaped (local jobs, `study` subprocesses; SLURM jobs are not
    children), beside its wall time, when it ended and on which worker. The suite is CPU-bound on two cores: this
    says which tests to shrink, and the end times which worker's chain sets the suite's wall time."""
    path = os.environ.get("STUDY_TEST_CPU")
    before, start = os.times(), time.monotonic()
    yield
    if path:
        after = os.times()
        own = after.user + after.system - before.user - before.system
        children = after.children_user + after.children_system - before.children_user - before.children_system
        with open(path, "a") as out:
            out.write(json.dumps({"test": item.nodeid, "cpu": round(own, 2), "children_cpu": round(children, 2),
                                  "wall": round(time.monotonic() - start, 2), "ended": round(time.time(), 1),
                                  "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}) + "\n")
