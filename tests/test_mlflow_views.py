"""What the MLflow UI shows, read back from a real local store (SQLite): the report run's report.html opens from the
artifact view on its own (the UI loads an .html artifact into a sandboxed iframe from a blob URL, where nothing
relative to the page resolves), and a parent run carries its seed runs' dataset input like they do."""

from __future__ import annotations

import base64
import json
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow import MlflowClient

from analysis.report import build_report
from benchmarks.synthetic_store import synthetic_store
from conftest import new_store
from study import schema
from study.track.groups import parent_for, refresh
from study.track.lineage import DATASET_CONTEXT, PARENT, dataset_input

PNG = b"\x89PNG\r\n\x1a\n"


class _References(HTMLParser):
    """Every URL-bearing attribute of a page, and the tags that could load something from elsewhere."""

    def __init__(self):
        super().__init__()
        self.urls: list[tuple[str, str, str]] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        for name, value in attrs:
            if name in ("src", "href", "srcset", "data", "action", "poster"):
                self.urls.append((tag, name, value or ""))


@pytest.mark.integration
def test_report_html_artifact_is_the_page_written_with_every_figure_embedded_and_nothing_loaded_from_elsewhere(
        tmp_path):
    uri = new_store(tmp_path / "mlflow.db")
    synthetic_store(uri, "view", ["base", "new"], ["20M", "40M", "80M", "160M"], seeds=3, steps=20, eval_tasks=(),
                    effects={"new": -0.02}, rng_seed=2)
    result = build_report("view", tracking_uri=uri, out_dir=tmp_path / "reports", n_resamples=99)
    client = MlflowClient(uri)
    run_id = result["report_run_id"]
    root = {a.path: a for a in client.list_artifacts(run_id)}
    # at the artifact root, named .html: the artifact view picks its HTML viewer by the extension
    assert "report.html" in root and not root["report.html"].is_dir
    page = Path(client.download_artifacts(run_id, "report.html", str(tmp_path / "down"))).read_bytes()
    assert page == (tmp_path / "reports" / "view" / "report.html").read_bytes()
    refs = _References()
    refs.feed(page.decode("utf-8"))
    assert not {"script", "link", "iframe", "object", "embed", "base"} & set(refs.tags)
    images = [value for tag, _, value in refs.urls if tag == "img"]
    assert all(value.startswith("data:image/png;base64,") for value in images)
    assert all(tag == "img" for tag, _, _ in refs.urls)  # no link to a file beside the page
    embedded = [base64.b64decode(value.split(",", 1)[1]) for value in images]
    assert embedded and all(data.startswith(PNG) for data in embedded)
    logged = {p: Path(client.download_artifacts(run_id, p, str(tmp_path / "pngs"))).read_bytes()
              for p in root if p.endswith(".png")}
    # each figure the page shows is byte for byte a PNG the run also holds as a file
    assert sorted(embedded) == sorted(logged[p] for p in logged if logged[p] in embedded)
    assert {"scaling.png", "loss_curves.png", "forest_val_loss.png"} <= {p for p in logged if logged[p] in embedded}


def _shards(tmp_path: Path, text: str):
    """What `dataset_input` reads of a run's data: shard metadata (checksums, split counts) and the data config."""
    meta = {"sha256": {"train.bin": text}, "splits": {"train": {"tokens": 1000, "documents": 10}},
            "vocab_size": 256, "dtype": "uint16"}
    data = SimpleNamespace(meta=meta, shard_dir=tmp_path / text)
    return dataset_input(data, SimpleNamespace(name="docstrings", config_name=None, tokens=None, val_tokens=None))


def test_a_parent_run_carries_the_dataset_input_of_its_seed_runs_once_per_digest(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment_id = client.create_experiment("cells")
    tags = {schema.TAG_EXPERIMENT: "cells", schema.TAG_VARIANT: "conventional", schema.TAG_SCALE: "tiny",
            schema.TAG_ROLE: "main"}
    parent = parent_for(client, experiment_id, tags)
    same, other = _shards(tmp_path, "aaaa"), _shards(tmp_path, "bbbb")
    seeds = []

    def seed_run(seed: int, inputs: list) -> str:
        run_id = client.create_run(experiment_id, tags={**tags, schema.TAG_SEED: str(seed), PARENT: parent}).info.run_id
        client.log_inputs(run_id, datasets=inputs)
        client.log_metric(run_id, schema.VAL_LOSS, 3.0 + seed, step=4)
        seeds.append(run_id)
        return run_id

    seed_run(0, [same]), seed_run(1, [same])
    client.set_terminated(seeds[0], "FINISHED")
    refresh(client, seeds[0])
    refresh(client, seeds[0])  # a second summary adds no second copy
    (carried,) = client.get_run(parent).inputs.dataset_inputs
    seed_input = client.get_run(seeds[0]).inputs.dataset_inputs[0]
    assert carried.dataset.digest == same.dataset.digest == seed_input.dataset.digest
    assert (carried.dataset.name, carried.dataset.source, carried.dataset.profile) == (
        seed_input.dataset.name, seed_input.dataset.source, seed_input.dataset.profile)
    assert json.loads(carried.dataset.profile)["train_tokens"] == 1000
    assert [(t.key, t.value) for t in carried.tags] == [(DATASET_CONTEXT, "training")]
    # a seed run on other shards (another tokenizer, say) adds its own when the summary next runs
    client.set_terminated(seed_run(2, [other]), "FINISHED")
    refresh(client, seeds[2])
    digests = sorted(i.dataset.digest for i in client.get_run(parent).inputs.dataset_inputs)
    assert digests == sorted([same.dataset.digest, other.dataset.digest])
    listed = client.search_runs([experiment_id], filter_string=f"tags.`{schema.TAG_ROLE}` = 'group'")
    assert [r.info.run_id for r in listed] == [parent] and len(listed[0].inputs.dataset_inputs) == 2


def test_a_branched_cells_parent_summarises_its_planned_runs_ends_and_a_trunk_keeps_its_own_curve(tmp_path):
    """A branch nests under its trunk, the trunk under its (variant, scale) parent. The parent's val/loss is the mean
    of the branches as long as their trunk's recipe (the planned runs' ends) over the seeds; a trunk, a branch's own
    parent, never takes a summary (its curve would gain the means of its branches at steps 1, 2, ...)."""
    client = MlflowClient(new_store(tmp_path / "mlflow.db"))
    exp = client.create_experiment("branched")
    cell = {schema.TAG_EXPERIMENT: "branched", schema.TAG_VARIANT: "conventional", schema.TAG_SCALE: "tiny"}
    parent = parent_for(client, exp, {**cell, schema.TAG_ROLE: "trunk"})
    ends, trunks = {}, []
    for seed in (0, 1):
        tags = {**cell, schema.TAG_SEED: str(seed)}
        trunk = client.create_run(exp, tags={**tags, schema.TAG_ROLE: "trunk", PARENT: parent}).info.run_id
        client.log_param(trunk, "recipe.max_steps", 40)
        for step, value in ((10, 6.0), (20, 5.5), (32, 5.2)):
            client.log_metric(trunk, schema.VAL_LOSS, value, step=step)
        client.set_terminated(trunk, "FINISHED")
        trunks.append(trunk)
        for steps, loss in ((20, 5.4 + seed / 10), (40, 5.0 + seed / 10)):
            branch = client.create_run(exp, tags={**tags, schema.TAG_ROLE: "branch", PARENT: trunk,
                                                  schema.TAG_BRANCH_AT: f"{steps / 40:g}"}).info.run_id
            client.log_param(branch, "recipe.max_steps", steps)
            client.log_metric(branch, schema.VAL_LOSS, loss, step=steps)
            client.set_terminated(branch, "FINISHED")
            ends[seed, steps] = loss
    for run_id in [*trunks, *(r.info.run_id for r in client.search_runs([exp], f"tags.`{schema.TAG_ROLE}` = 'branch'"))]:
        refresh(client, run_id)  # as each run's job does when it finishes
    summary = client.get_run(parent).data.metrics
    assert summary[schema.VAL_LOSS] == pytest.approx((ends[0, 40] + ends[1, 40]) / 2, rel=1e-12)
    assert summary[f"{schema.VAL_LOSS}/n"] == 2
    for trunk in trunks:
        assert set(client.get_run(trunk).data.metrics) == {schema.VAL_LOSS}
        assert [(m.step, m.value) for m in client.get_metric_history(trunk, schema.VAL_LOSS)] == [
            (10, 6.0), (20, 5.5), (32, 5.2)]


@pytest.fixture(autouse=True)
def _no_ambient_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def test_a_store_written_before_the_role_tag_is_read_by_its_study_stage_tag(tmp_path):
    """Runs tagged only `study.stage` (the tag the role had before `study.role`): a tune run and a parent stay out of
    the main runs, the report run is found and reused, and a run's role reads from the old tag."""
    from mlflow.tracking import MlflowClient

    from analysis.run_table import read_study
    from study.track.query import runs_with_role

    uri = new_store(tmp_path / "mlflow.db")
    client = MlflowClient(uri)
    exp = client.create_experiment("old")
    base = {schema.TAG_EXPERIMENT: "old", schema.TAG_VARIANT: "conventional", schema.TAG_SCALE: "tiny",
            schema.TAG_BASELINE: "conventional"}
    ids = {}
    for name, role, seed in (("main", "train", "0"), ("tune", "tune", "0"), ("group", "group", None),
                             ("report", "report", None)):
        tags = {**base, schema.OLD_TAG_ROLE: role, **({schema.TAG_SEED: seed, schema.TAG_RUN_KEY: name * 2}
                                                      if seed else {})}
        ids[name] = client.create_run(exp, run_name=name, tags=tags).info.run_id
        client.log_metric(ids[name], schema.VAL_LOSS, 3.0)
        client.set_terminated(ids[name], "FINISHED")
    study = read_study("old", uri)
    assert list(study.runs["run_id"]) == [ids["main"]] and list(study.runs["role"]) == ["train"]
    assert list(study.tune["run_id"]) == [ids["tune"]]
    assert [r.info.run_id for r in runs_with_role(client, [exp], schema.ROLE_REPORT)] == [ids["report"]]
    # a run written now carries the new tag, and is what the search finds first
    new = client.create_run(exp, run_name="report", tags={schema.TAG_ROLE: schema.ROLE_REPORT}).info.run_id
    assert [r.info.run_id for r in runs_with_role(client, [exp], schema.ROLE_REPORT)] == [new]
    assert schema.role_of({schema.TAG_ROLE: "tune", schema.OLD_TAG_ROLE: "train"}) == "tune"


def test_no_tag_name_schema_declares_is_spelt_out_in_code_elsewhere():
    """Tag names live in study/schema.py: no string in study/ or analysis/ code (docstrings aside) spells one; they
    come from the schema's constants."""
    import ast
    import re

    from conftest import ROOT

    declared = {v for k, v in vars(schema).items() if k.startswith("TAG_") and isinstance(v, str)}
    # a tag name followed by `.word` is a module path (`study.launch.warm`), not the tag `study.launch`
    pattern = re.compile("|".join(rf"(?<![\w.]){re.escape(t)}(?![\w]|\.\w)"
                                  for t in sorted(declared, key=len, reverse=True)))
    found = []
    for path in [*(ROOT / "study").rglob("*.py"), *(ROOT / "analysis").rglob("*.py")]:
        if path == ROOT / "study" / "schema.py":
            continue
        tree = ast.parse(path.read_text())
        # docstrings, of modules, classes, functions and fields alike, are the strings that stand as statements
        docstrings = {id(node.value) for node in ast.walk(tree)
                      if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and pattern.search(node.value)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:60]!r}")
    assert found == []
