"""Records and files a user can edit or damage by hand, read by the real command: a directory in a file's place, a
file that is not UTF-8 or not JSON, a JSON of another shape, a missing field or an absurd number (1e308) is refused
in one paragraph naming the file and the fix, exit status 2, no traceback, and the file is left as it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, TINY
from study.cli import main
from study.config.compose import nested
from study.config.run import Role
from study.schema import EVAL_RECORD

SETTINGS = nested({k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in TINY if not s.startswith("scale="))})
SETTINGS["train"].update(max_steps=8, ckpt_interval=4, val_interval=4)
EXPERIMENTS = {
    # one tuned arm; its main run is evaluated after training
    "tuned": {"baseline": "a", "scales": ["tiny"], "seeds": [0], "variants": {"a": {"model": "conventional"}},
              "tune": {"lr": [0.5, 1, 2], "scale": "tiny", "seeds": [0], "extend": 1},
              "common": {**SETTINGS, "eval": {"tasks": ["arc_easy_local"], "after_train": True}}},
    # two arms racing on decay branches
    "raced": {"baseline": "a", "scales": ["tiny"], "seeds": [0, 1], "variants": {"a": {"model": "conventional"},
                                                                                 "b": {"model": "tapered"}},
              "branches": {"at": [0.5, 1.0], "decay": 0.25}, "racing": True,
              "common": {**SETTINGS, "train": {**SETTINGS["train"], "lr_schedule": "wsd"}}},
}
MULTIPLE_BEST = 1.0


@pytest.fixture(scope="module")
def study(tmp_path_factory, data_cache):
    """A working directory where `tuned` has decided its tuning (tune runs settled, the record written) and its main
    run finished, and `raced` has its roster and a decided first rung; each experiment launched once (manifest and
    job journal). Nothing trained: every result is written as the trainer writes it."""
    from study.launch.manifest import manifest_path
    from study.launch.racing import RECORD, write_roster
    from study.launch.scheduler import append_lines, journal_path, record
    from study.launch.submit import write_specs
    from study.plan.planner import plan_experiment
    from study.schema import launch_dir

    root = tmp_path_factory.mktemp("damaged")
    tree = root / "sweeps"
    shutil.copytree(ROOT / "sweeps", tree)
    for name, spec in EXPERIMENTS.items():
        (tree / "experiment" / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setenv("STUDY_SWEEPS", str(tree))
        mp.setenv("SLURM_CONF", str(root / "no-slurm.conf"))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        for _ in range(4):  # tune points settle as the grid asks for them
            plan = plan_experiment("tuned")
            fresh = [r for r in plan.runs if r.role == Role.tune and not r.run_dir.result.exists()]
            for r in fresh:
                finish(r, 3.0 + (r.tuned.multiple - MULTIPLE_BEST) ** 2)
            if not fresh:
                break
        write_specs(plan, echo=lambda m: None)
        plan = plan_experiment("tuned")
        main_run = next(r for r in plan.runs if r.role != Role.tune)
        assert not main_run.awaits_tuning
        write_specs(plan, echo=lambda m: None)
        finish(main_run, 3.1)
        raced = plan_experiment("raced")
        write_roster(raced)
        runs = raced.runs[0].config.paths.runs
        for name, p in (("tuned", plan), ("raced", raced)):
            append_lines(manifest_path(runs, name), [{"experiment": name, "overrides": [],
                                                      "keys": [r.key for r in p.runs], "time": 0.0}])
            record(runs, name, [{"key": p.runs[0].key, "job_id": "4242", "stage": "train", "scheduler": "local",
                                 "name": p.runs[0].name, "after": [], "host": "elsewhere", "time": 0.0}])
        verdict = {"at": 0.5, "variant": "b", "scale": "tiny", "baseline": "a", "rung": 1, "verdict": "worse",
                   "n": 2, "mean_delta": 0.5, "ci_low": 0.4, "ci_high": 0.6, "alpha": 0.006, "stops": True}
        (launch_dir(runs, "raced") / RECORD).write_text(json.dumps(verdict) + "\n")
        tune = next(r for r in plan.runs if r.role == Role.tune)
        yield {"root": root, "tuned": plan, "raced": raced, "main": main_run, "tune": tune,
               "journal": journal_path(runs, "tuned"), "manifest": manifest_path(runs, "tuned"),
               "race": launch_dir(runs, "raced") / RECORD,
               "record": Path("runs", "tuned", "_tune", "a.json")}  # as paths.runs names it


def finish(run, loss: float) -> None:
    """The run's result.json as its trainer writes it when training finished."""
    run.run_dir.path.mkdir(parents=True, exist_ok=True)
    run.run_dir.result.write_text(json.dumps({"val_loss": loss, "step": run.planned.max_steps, "run_key": run.key}))


@pytest.fixture
def damage(study, monkeypatch):
    """damage(path, content): the file replaced by `content` (bytes, text, or DIRECTORY), restored afterwards."""
    monkeypatch.chdir(study["root"])
    kept: list[tuple[Path, bytes | None]] = []

    def put(path: Path, content) -> None:
        kept.append((path, path.read_bytes() if path.is_file() else None))
        if content is DIRECTORY:
            path.unlink(missing_ok=True)
            (path / "inside").mkdir(parents=True)
        else:
            path.write_bytes(content if isinstance(content, bytes) else content.encode())

    yield put
    for path, before in reversed(kept):
        if path.is_dir():
            shutil.rmtree(path)
        if before is not None:
            path.write_bytes(before)


DIRECTORY = object()


def refused(argv: list[str], capsys, path: Path, problem: str, fix: str) -> None:
    """The command is refused in one paragraph naming the file, what is wrong with it and the fix; exit status 2."""
    before = path.read_bytes() if path.is_file() else None
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    err = " ".join(err.split())
    named = {str(path), str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)}
    assert any(f"error in `{p}" in err for p in named), err
    assert problem in err and f"Fix: {fix}" in err, err
    assert (path.read_bytes() if path.is_file() else None) == before  # left as it was


def line_of(entry: dict, **change) -> str:
    return json.dumps({**entry, **change}) + "\n"


RESULT_FIX = "delete {path}: the run's next start (`study launch EXPERIMENT`, or `study train`) finishes it again"

# name -> (the file's new content, what the refusal says is wrong)
DAMAGED_RESULTS = {
    "directory": (DIRECTORY, "is a directory, not a file"),
    "not_utf8": (b'{"val_loss": 3.0, "step": 8, "run_key": "\xff"}', "is not UTF-8 text (byte 0xff"),
    "not_json": ('{"val_loss": 3.0, "st', "does not read as JSON"),
    "a_list": ("[3.0, 8]", "holds a JSON list, not a mapping"),
    "no_val_loss": (lambda key: {"step": 8, "run_key": key}, "has no `val_loss`"),
    "val_loss_1e308": (lambda key: {"val_loss": 1e308, "step": 8, "run_key": key},
                       "has `val_loss` 1e+308, not a finite loss from 0 to 1e+100"),
    "val_loss_text": (lambda key: {"val_loss": "3.0", "step": 8, "run_key": key}, "has `val_loss` \"3.0\", not a"),
    "step_negative": (lambda key: {"val_loss": 3.0, "step": -1, "run_key": key}, "has `step` -1, not a whole number"),
}


@pytest.mark.parametrize("kind", DAMAGED_RESULTS)
@pytest.mark.parametrize("command", ["plan", "status"])
def test_a_damaged_tune_run_result_is_refused_naming_the_file(study, damage, capsys, kind, command):
    """The plan reads every tune run's result.json to decide the tuning: one without its loss was a KeyError."""
    content, problem = DAMAGED_RESULTS[kind]
    path = study["tune"].run_dir.result
    damage(path, json.dumps(content(study["tune"].key)) if callable(content) else content)
    refused([command, "tuned"], capsys, path, problem, RESULT_FIX.format(path=path))


def test_a_damaged_main_run_result_is_refused_by_status(study, damage, capsys):
    path = study["main"].run_dir.result
    damage(path, json.dumps({"val_loss": None, "step": 8, "run_key": study["main"].key}))
    refused(["status", "tuned"], capsys, path, "has `val_loss` null, not a finite loss", RESULT_FIX.format(path=path))


def test_a_result_of_another_run_key_is_still_none_of_this_runs(study, damage, capsys):
    path = study["main"].run_dir.result
    damage(path, json.dumps({"val_loss": 3.0, "step": 8, "run_key": "0" * 12}))
    assert main(["status", "tuned", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    row = next(r for r in (rows["runs"] if isinstance(rows, dict) else rows) if r["key"] == study["main"].key)
    assert row.get("val_loss") is None


TUNE_FIX = "delete {path}: the next `study launch` recomputes it from the finished tune runs"


@pytest.mark.parametrize("content,problem", [
    (DIRECTORY, "is a directory, not a file"),
    (b'{"version": 2, "note": "\xe9"}', "is not UTF-8 text (byte 0xe9"),
    (lambda r: r["scales"]["tiny"]["points"][0].update(losses=[1e308]), "is neither a finite number from 0 to 1e+100"),
    (lambda r: r["scales"]["tiny"].update(best=1e308), "must be positive finite numbers up to 1e+100"),
], ids=["directory", "not_utf8", "loss_1e308", "best_1e308"])
def test_a_damaged_tuning_record_is_refused_naming_the_file(study, damage, capsys, content, problem):
    """A directory in the record's place was taken for no record, and written over (IsADirectoryError)."""
    path = study["record"]
    if callable(content):
        record = json.loads(path.read_text())
        content(record)
        content = json.dumps(record)
    damage(path, content)
    for command in ("plan", "launch"):
        refused([command, "tuned", "cluster=local"], capsys, path, problem, TUNE_FIX.format(path=path))


VERDICT = {"at": 0.5, "variant": "b", "scale": "tiny", "baseline": "a", "rung": 1, "verdict": "worse", "n": 2,
           "mean_delta": 0.5, "ci_low": 0.4, "ci_high": 0.6, "alpha": 0.006, "stops": True}
RACE_FIX = "delete the damaged line of {path} (or the whole file): the rungs it no longer records are decided again"


@pytest.mark.parametrize("content,problem", [
    (line_of({k: v for k, v in VERDICT.items() if k != "at"}), "line 1 has no `at`"),
    (line_of(VERDICT, mean_delta=None), "line 1 has `mean_delta` null, not a finite number"),
    (line_of(VERDICT, at="0.5"), "line 1 has `at` \"0.5\", not a finite number"),
    (line_of(VERDICT, at=1e308), "line 1 has `at` 1e+308, not a finite number of magnitude at most 1e+100"),
    ("[0.5, \"b\"]\n" + line_of(VERDICT), "line 1 holds a JSON list, not a mapping"),
    ('{"at": 0.5, "vari\n' + line_of(VERDICT), "line 1 does not read as JSON"),
    (line_of(VERDICT).encode() + b'{"at": "\xff"}\n', "is not UTF-8 text (byte 0xff"),
    (DIRECTORY, "is a directory, not a file"),
], ids=["no_at", "null_delta", "text_at", "at_1e308", "a_list", "cut_mid_file", "not_utf8", "directory"])
def test_a_damaged_racing_record_is_refused_naming_the_file_and_line(study, damage, capsys, content, problem):
    """`study status` reads racing.jsonl for the arms the race stopped: a hand-edited line was a KeyError."""
    path = study["race"]
    damage(path, content)
    refused(["status", "raced"], capsys, path, problem, RACE_FIX.format(path=path))


def test_a_racing_record_whose_last_line_a_kill_cut_short_reads_without_it_and_the_next_append_removes_it(
        study, damage, capsys):
    from study.launch.racing import decided
    from study.launch.scheduler import append_lines

    path, runs = study["race"], study["raced"].runs[0].config.paths.runs
    damage(path, line_of(VERDICT) + '{"at": 1.0, "variant": "a", "sc')
    assert decided(runs, "raced") == [VERDICT]
    assert main(["status", "raced"]) == 0
    later = {**VERDICT, "at": 1.0, "rung": 2}
    append_lines(path, [later])
    assert path.read_text() == line_of(VERDICT) + line_of(later)  # never glued to the half line
    assert decided(runs, "raced") == [VERDICT, later]


def test_a_damaged_racing_roster_is_refused_naming_the_file(study, damage):
    """The roster is read by every branch job that settles the race (and a local launch)."""
    from study.errors import StudyError
    from study.launch.racing import ROSTER, settle
    from study.schema import launch_dir

    runs = study["raced"].runs[0].config.paths.runs
    path = launch_dir(runs, "raced") / ROSTER
    roster = json.loads(path.read_text())
    fix = f"delete {path}: the next `study launch` of the experiment writes it again from its plan"
    for content, problem in ((json.dumps({**roster, "runs": [{**roster["runs"][0], "seed": "0"}]}),
                              'runs[0] has `seed` "0", not a whole number'),
                             (json.dumps({**roster, "decision": {**roster["decision"], "alpha": 7}}),
                              "`decision.alpha` must lie strictly between 0.0 and 0.5, got 7"),
                             (json.dumps({k: v for k, v in roster.items() if k != "baseline"}), "has no `baseline`"),
                             (DIRECTORY, "is a directory, not a file")):
        damage(path, content)
        with pytest.raises(StudyError) as err:
            settle(runs, "raced")
        assert err.value.field == str(path) and problem in err.value.problem and err.value.fix == fix


JOURNAL_ENTRY = {"key": "k", "job_id": "4242", "stage": "train", "scheduler": "local", "name": "n", "after": [],
                 "host": "elsewhere", "time": 0.0}


@pytest.mark.parametrize("content,problem", [
    (line_of({k: v for k, v in JOURNAL_ENTRY.items() if k != "job_id"}), "line 1 has no `job_id`"),
    (line_of(JOURNAL_ENTRY, after=[[1]]), "line 1 has `after` [[1]], not a list of text"),
    ("not json\n" + line_of(JOURNAL_ENTRY), "line 1 does not read as JSON"),
    (DIRECTORY, "is a directory, not a file"),
], ids=["no_job_id", "nested_after", "not_json", "directory"])
def test_a_damaged_job_journal_is_refused_naming_the_file_and_line(study, damage, capsys, content, problem):
    path = study["journal"]
    damage(path, content)
    refused(["status", "tuned"], capsys, path, problem,
            f"delete the damaged line of {path}, or the whole file once none of the experiment's jobs is queued")


@pytest.mark.parametrize("content,problem", [
    (line_of({"experiment": "tuned", "overrides": "seed=1", "keys": []}), 'line 1 has `overrides` "seed=1", not a'),
    (line_of({"experiment": "tuned", "overrides": [], "keys": [], "extra_seeds": {"tiny": [3]}}),
     "line 1 has `extra_seeds` {'tiny': [3]}, not seeds per scale and variant"),
    (line_of({"experiment": "tuned", "overrides": []}), "line 1 has no `keys`"),
    (b"\xfe\xff\n", "is not UTF-8 text (byte 0xfe"),
], ids=["overrides_text", "extra_seeds_list", "no_keys", "not_utf8"])
def test_a_damaged_launch_manifest_is_refused_naming_the_file_and_line(study, damage, capsys, content, problem):
    path = study["manifest"]
    damage(path, content)
    refused(["status", "tuned"], capsys, path, problem, f"delete the damaged line of {path}, or the whole file")


@pytest.mark.parametrize("content,problem", [
    ("{}", "has no `id`"),
    (lambda r: {**r, "step": "8"}, 'has `step` "8", not a whole number'),
    (lambda r: {**r, "time": 1e308}, "has `time` 1e+308, not a finite number"),
    ("[]", "holds a JSON list, not a mapping"),
    (DIRECTORY, "is a directory, not a file"),
], ids=["empty", "step_text", "time_1e308", "a_list", "directory"])
def test_a_damaged_evaluation_record_is_refused_naming_the_file(study, damage, capsys, content, problem):
    """`study status` asks whether a finished run was evaluated (`eval.after_train`); a record that did not read was
    skipped silently and one of another shape was an AttributeError."""
    spec = study["main"]
    path = spec.run_dir.evals / "step00000008-all-0shot-0123abcd" / EVAL_RECORD
    record = {"id": path.parent.name, "run_key": spec.key, "step": 8, "tasks": ["arc_easy_local"], "limit": None,
              "num_fewshot": 0, "of_record": True, "time": 1.0, "metrics": {}}
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        damage(path, json.dumps(content(record)) if callable(content) else content)
        fix = f"delete {path.parent}: `study eval {spec.key}` (for the evaluation of record, the next `study launch`)"
        refused(["status", "tuned"], capsys, path, problem, fix)
    finally:
        shutil.rmtree(spec.run_dir.evals)


def test_an_evaluation_still_being_written_is_no_record_yet(study, capsys):
    spec = study["main"]
    hidden = spec.run_dir.evals / ".step00000008-all-0shot-0123abcd.77.tmp" / EVAL_RECORD
    hidden.parent.mkdir(parents=True)
    try:
        hidden.write_text('{"id": "step0')
        assert main(["status", "tuned"]) == 0
    finally:
        shutil.rmtree(spec.run_dir.evals)


@pytest.mark.parametrize("content,problem", [
    ("[]", "holds a JSON list, not a mapping"),
    ('{"schema": ', "does not read as JSON"),
    (b'{"schema": "\x80"}', "is not UTF-8 text (byte 0x80"),
], ids=["a_list", "not_json", "not_utf8"])
def test_a_damaged_run_spec_is_refused_naming_the_file(study, damage, capsys, content, problem):
    path = study["main"].run_dir.spec.relative_to(study["root"])  # as paths.runs names it
    damage(path, content)
    refused(["eval", study["main"].key, "paths.runs=runs"], capsys, path, problem,
            f"delete {path}: the next `study launch EXPERIMENT` writes the run's spec again from its plan")


@pytest.mark.parametrize("section,name,value,problem,fix", [
    ("config", "train", {"lr_schedule": "bogus"}, "has `config.train.lr_schedule`: unknown value 'bogus'",
     "use one of cosine, wsd"),
    ("config", "train", {"beta2": 1.5}, "has `config.train.beta1`: AdamW betas must lie in [0, 1)",
     "use e.g. beta1=0.9 beta2=0.95"),
    ("recipe", None, {"lr_schedule": "linear"}, "has `recipe.lr_schedule`: unknown value 'linear'",
     "use one of cosine, wsd"),
], ids=["config_schedule", "config_beta", "recipe_schedule"])
def test_a_hand_edited_value_in_a_run_spec_is_refused_naming_the_file_and_the_field(study, damage, capsys, section,
                                                                                    name, value, problem, fix):
    """A value the planner would refuse, written into run.json by hand: training failed deep inside on it (an unknown
    schedule in the recipe) or ignored it (the config's, which the recipe overrides)."""
    path = study["main"].run_dir.spec.relative_to(study["root"])
    raw = json.loads(path.read_text())
    (raw[section][name] if name else raw[section]).update(value)
    damage(path, json.dumps(raw))
    refused(["eval", study["main"].key, "paths.runs=runs"], capsys, path, problem,
            f"{fix} (in that file), or delete {path}: the next `study launch EXPERIMENT` writes the run's spec again from "
            "its plan")


def test_a_profile_holding_1e308_is_refused_naming_the_file_and_the_layer(study, tmp_path, capsys):
    """Finite, yet past anything measured: the allocator's sums overflowed to NaN inside scipy's solver."""
    from test_bad_input import tiny_profile

    profile = tiny_profile()
    for per in profile["stats"].values():
        for geometry in per:
            per[geometry] = [1e308] * 4
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    assert main(["allocate", "--profile", str(path), "--budget-from", "demo:tiny"]) == 2
    assert capsys.readouterr().err == (
        f"study allocate: error in `{path}: stats.shift.raw`: layer 0 holds 1e+308, past the 1e+100 no measured value "
        "comes near. Fix: profile the reference run again (`study profile RUN_KEY` rewrites its profile.json)\n")


@pytest.mark.parametrize("out", ["/sys/x", "/proc/x"])
def test_a_report_out_where_nothing_can_be_made_is_refused_before_anything_is_read(out, tmp_path, monkeypatch,
                                                                                  capsys):
    """os.access says yes to root for /sys; the folder is made and removed instead of asked about."""
    monkeypatch.chdir(tmp_path)
    assert main(["report", "demo", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"study report: error in `--out`: cannot write in {Path(out).parent} (")
    assert "Fix: give a folder you can write to" in err and not Path(out).exists() and list(tmp_path.iterdir()) == []


def _checkpointed(spec) -> Path:
    """A real checkpoint of the run's model at its last step, as training saves it."""
    import torch

    from study.models.transformer import build_model
    from study.train import checkpoint
    from study.train.distributed import Dist
    from study.train.state import TrainState

    model = build_model(spec.model, "cpu", seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    state = TrainState(step=spec.planned.max_steps, max_steps=spec.planned.max_steps, run_key=spec.key)
    return checkpoint.save(spec.run_dir.path, model, optimizer, state, Dist(0, 1, 0, "cpu"), keep_last=2)


def _cut(folder: Path) -> None:
    """Every shard of the checkpoint cut short, as a copy interrupted early leaves it."""
    for shard in folder.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 100])


CUT_SHORT = "RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory"
"""What torch says of a shard cut short: the first sentence of its message, without its advice."""


def test_what_failed_in_a_checkpoint_is_said_in_one_line_an_eof_error_and_dcps_chain_too():
    from study.train.checkpoint import _reason

    cut = "EOFError: one of its files ends before its data does: cut short"
    assert _reason(EOFError()) == cut
    try:
        try:
            raise EOFError("Ran out of input")
        except EOFError:  # DCP tries the rank's own metadata once .metadata fails, and says that one is missing
            raise FileNotFoundError(2, "No such file or directory", "step_00000008/__0.metadata")  # noqa: B904
    except FileNotFoundError as err:
        assert _reason(err) == cut


def test_a_truncated_checkpoint_is_refused_naming_its_folder_not_as_eof_alone(study, capsys):
    spec = study["main"]
    folder = _checkpointed(spec)
    try:
        _cut(folder)
        assert main(["eval", spec.key, "paths.runs=runs"]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert err.startswith(f"study eval: error in `{folder}`: the checkpoint cannot be loaded ({CUT_SHORT})")
        assert err.endswith(f"Fix: restore {folder} from a copy, or delete that folder to read the run's checkpoint "
                            "before it")
    finally:
        shutil.rmtree(spec.run_dir.checkpoints)


def test_a_branch_whose_trunk_checkpoint_is_truncated_is_refused_naming_the_folder_and_the_restart(study):
    """No earlier checkpoint is a branch's start: the trunk's at the branch step is loaded or the branch refused."""
    import torch

    from study.errors import StudyError
    from study.models.transformer import build_model
    from study.train import checkpoint
    from study.train.distributed import Dist

    trunk = next(r for r in study["raced"].runs if r.role == Role.trunk)
    folder = _checkpointed(trunk)
    try:
        _cut(folder)
        model = build_model(trunk.model, "cpu", seed=0)
        with pytest.raises(StudyError) as err:
            checkpoint.load_branch_start(trunk.run_dir.path, trunk.planned.max_steps, model,
                                         torch.optim.AdamW(model.parameters()), Dist(0, 1, 0, "cpu"), trunk.key)
        assert err.value.field == str(folder)
        assert err.value.problem == (f"trunk {trunk.key}'s checkpoint at step {trunk.planned.max_steps}, where this "
                                     f"branch starts, cannot be loaded ({CUT_SHORT})")
        assert err.value.fix == (f"restore {folder} from a copy; else train the trunk again from step 0 (`study "
                                 f"launch raced --restart {trunk.key}`)")
    finally:
        shutil.rmtree(trunk.run_dir.path)


@pytest.mark.parametrize("content,problem", [
    ('{"step": "8"}', 'has `step` "8", not a whole number'),
    ('{"step": 8, "run_key": 7}', "has `run_key` 7, not text"),
    ("{", "does not read as JSON"),
], ids=["step_text", "key_number", "not_json"])
def test_a_damaged_train_state_is_refused_naming_the_file(study, content, problem):
    """lm-eval's `checkpoint=PATH` reads the checkpoint's train_state.json for the run it belongs to."""
    from study.errors import StudyError
    from study.eval.locate import run_of_checkpoint

    spec = study["main"]
    folder = _checkpointed(spec)
    try:
        (folder / "train_state.json").write_text(content)
        with pytest.raises(StudyError) as err:
            run_of_checkpoint(folder)
        assert err.value.field == str(folder.resolve() / "train_state.json") and problem in err.value.problem
        assert err.value.fix.startswith(f"restore {folder.resolve()} from a copy, or delete that checkpoint folder")
    finally:
        shutil.rmtree(spec.run_dir.checkpoints)


@pytest.mark.parametrize("content,problem", [
    ('["train/loss", 3.0, 1000, 1]\n["train/loss", "x", 1000, 2]\n["train/loss", 3.0, 1000, 3]\n',
     'line 2 holds ["train/loss", "x", 1000, 2], not a point'),
    ('["train/loss", 3.0, 1000]\n["train/loss", 3.0, 1000, 3]\n', "line 1 holds"),
    ("garbage\n[\"train/loss\", 3.0, 1000, 3]\n", "line 1 does not read as JSON"),
], ids=["value_text", "three_fields", "not_json"])
def test_a_damaged_metric_log_is_refused_naming_the_file_and_line(tmp_path, content, problem):
    from study.errors import StudyError
    from study.track.tracker import MetricLog

    path = tmp_path / "metrics.jsonl"
    path.write_text(content)
    with pytest.raises(StudyError) as err:
        MetricLog(path).read()
    assert err.value.field == str(path) and problem in err.value.problem
    assert err.value.fix.startswith(f"delete the damaged line of {path}")


def test_a_metric_line_a_crash_cut_short_is_left_out_and_removed_by_the_next_append(tmp_path):
    from study.track.tracker import MetricLog

    path = tmp_path / "metrics.jsonl"
    path.write_text('["train/loss", 3.0, 1000, 1]\n["train/loss", 2.9, 10')
    log = MetricLog(path)
    assert log.read() == [("train/loss", 3.0, 1000, 1)]
    log.append([("train/loss", 2.8, 1001, 2)])
    log.close()
    assert path.read_text() == '["train/loss", 3.0, 1000, 1]\n["train/loss", 2.8, 1001, 2]\n'


def test_a_damaged_export_manifest_is_refused_naming_the_file(tmp_path):
    from study.errors import StudyError
    from study.export import load

    path = tmp_path / "study_export.json"
    fix = f"delete {tmp_path} and export the run again (`study export RUN_KEY --format study --out {tmp_path}`)"
    for content, problem in (("{", "does not read as JSON"), ('{"format": "study"}', "has no `spec`"),
                             ('{"format": "study", "spec": {}}', "has no `spec.config.model`")):
        path.write_text(content)
        with pytest.raises(StudyError) as err:
            load(tmp_path)
        assert err.value.field == str(path) and problem in err.value.problem and err.value.fix == fix


def test_a_damaged_tokenizer_config_is_refused_naming_the_file(tmp_path):
    from study.data.tokenizer import declared_eos
    from study.errors import StudyError

    path = tmp_path / "tokenizer_config.json"
    for content, problem in ((b'{"eos_token": "\xff"}', "is not UTF-8 text"), ('["</s>"]', "holds a JSON list"),
                             ('{"eos_token": 7}', "declares the end-of-document token 7, not a token's text")):
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(StudyError) as err:
            declared_eos(tmp_path)
        assert err.value.field == str(path) and problem in err.value.problem and "delete" in err.value.fix
    path.write_text('{"eos_token": {"content": "</s>"}}')
    assert declared_eos(tmp_path) == "</s>"


def test_a_damaged_data_record_is_refused_naming_the_file_and_the_restart(study, damage):
    from types import SimpleNamespace

    from study.errors import StudyError
    from study.train.loop import check_data, record_path

    spec = study["main"]
    path = record_path(spec)
    data = SimpleNamespace(meta={"sha256": {"train.bin": "ab"}, "kind": "shards"})
    for content, problem in (('{"sha256": ["ab"]}', "has `sha256` [\"ab\"], not a mapping of file names to digests"),
                             ('{"run_key": "x"}', "has no `sha256`"), (DIRECTORY, "is a directory, not a file")):
        damage(path, content)
        with pytest.raises(StudyError) as err:
            check_data(spec, data, write=False)
        assert err.value.field == str(path) and problem in err.value.problem
        assert err.value.fix == (f"restore {path} from a copy; or train the run again from step 0 on the data as it "
                                 f"is now (`study launch EXPERIMENT --restart {spec.key}`)")


def test_damaged_build_records_of_the_data_cache_are_refused_naming_the_build(tmp_path):
    import numpy as np

    from study.data.flat import SCANNED, _read_scanned
    from study.data.shards import PROGRESS, _resume
    from study.errors import StudyError

    (tmp_path / PROGRESS).write_text(json.dumps({"pass": 0, "docs": 5, "bytes": 9, "chunks": 1, "seconds": 1e308,
                                                 "splits": {}}))
    with pytest.raises(StudyError) as err:
        _resume(tmp_path, np.dtype("uint16"))
    assert err.value.field == str(tmp_path / PROGRESS) and "has `seconds` 1e+308" in err.value.problem
    assert err.value.fix.startswith(f"delete {tmp_path}: the next `study prepare`")
    (tmp_path / SCANNED).write_text(json.dumps({"a.bin": {"path": "a.bin", "tokens": 3}}))
    with pytest.raises(StudyError) as err:
        _read_scanned(tmp_path / SCANNED, tmp_path)
    assert err.value.field == str(tmp_path / SCANNED) and "its entry for a.bin has no `offset`" in err.value.problem


def test_a_lease_holding_bytes_that_are_not_utf8_is_shown_not_a_traceback(tmp_path):
    """A trainer waiting for the lease says who holds it from the file's text, whatever bytes a hand put there."""
    import fcntl
    import os

    from study.train.lease import Lease

    lease = Lease(tmp_path)
    lease.path.write_bytes(b"node\xff7 123\n")
    fd = os.open(lease.path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert not lease.try_acquire()
        assert lease.holder() == "node\ufffd7 123"
    finally:
        os.close(fd)
