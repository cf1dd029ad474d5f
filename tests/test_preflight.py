"""`study preflight`: each distinct shape stepped once on fake tensors over a fake process group of its real world
size. Memory held against arithmetic from the parameter count, torch's FLOPs against the plan's for every shipped
family of shapes, the cache, and the refusals (exit 2, nothing cached)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from study.cli import main
from study.plan.budget import flops_per_token
from study.plan.memory import run_memory
from study.plan.planner import group_options, plan_experiment
from study.train.preflight import GIB, Measured, measure, model_flops

pytestmark = pytest.mark.no_store  # preflight opens no MLflow store: the tests check that none appears


@pytest.fixture
def cache(workdir, tmp_path, monkeypatch):
    """An empty cache of this test's own: results kept by another test (or session) would be read, not measured."""
    monkeypatch.setenv("STUDY_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def conventional(*overrides: str):
    return next(r for r in plan_experiment("demo", ["cluster=local", *overrides]).runs
                if r.config.variant == "conventional")


def test_sharding_holds_a_shard_of_the_parameters_per_rank(cache, monkeypatch):
    """One rank holds every fp32 parameter; FSDP2 over 8 ranks an eighth of them (each tensor's rows padded to a
    multiple of 8); HSDP over 2 nodes x 4 ranks a quarter (sharded within a node, replicated across), a tied
    embedding once. AdamW keeps two states per parameter held. Torch's FLOPs per token are the plan's, and the peak
    kept without the trackers' per-module records is the one they record with them."""
    whole = conventional()
    total = whole.params["total"]  # the plan's exact count (study.plan.budget.count_params)
    one = measure(whole, trace=False)
    assert one.layout == "1 node x 1 rank, unsharded"
    assert one.params_gib * GIB == 4 * total
    assert one.flops_per_token == whole.flops_per_token

    spec = conventional("cluster.tasks_per_node=8")
    eight = measure(spec, trace=False)
    assert eight.layout == "1 node x 8 ranks, full"
    assert eight.params_gib * GIB == pytest.approx(4 * total / 8, rel=1e-4)
    assert eight.optimizer_gib == pytest.approx(2 * eight.params_gib, rel=1e-3)
    assert 0 < eight.peak_gib < one.peak_gib
    assert eight.flops_per_token == spec.flops_per_token
    monkeypatch.setattr("study.train.preflight.peak_only", lambda tracker: tracker)  # torch's whole bookkeeping
    assert measure(spec, trace=False).peak_gib == eight.peak_gib

    tied = conventional("cluster.nodes=2", "cluster.tasks_per_node=4", "model.tie_embeddings=true")
    hybrid = measure(tied, trace=False)
    assert hybrid.layout == "2 nodes x 4 ranks, hybrid"
    assert tied.params["total"] == total - tied.params["embedding"]  # the tied head is no second matrix
    assert hybrid.params_gib * GIB == pytest.approx(4 * tied.params["total"] / 4, rel=1e-4)
    assert hybrid.peak_gib > 0


def small(m):
    """The shape `m` at a size that counts in a blink: its first two and last two layers (where per-layer schedules
    differ most), d_model 32, 8 per head, widths scaled alike, a 128-token vocabulary; block, FFN kind, K, heads per
    layer, QK-norm and tied embeddings as they are."""
    keep = sorted({0, 1, m.n_layers - 2, m.n_layers - 1})
    widths = [max(m.ffn.k, round(m.ffn.widths[l] * 32 / m.d_model)) for l in keep]
    heads = None if m.layer_heads is None else [m.layer_heads[l] for l in keep]
    return replace(m, d_model=32, n_layers=len(keep), head_dim=8, vocab_size=128, max_seq_len=16, layer_heads=heads,
                   ffn=replace(m.ffn, widths=widths))


def test_torch_counts_the_plans_flops_per_token_for_every_shipped_shape(workdir):
    """Every family of shapes the shipped experiments train (block, FFN kind, heads per layer, grouped KV heads,
    QK-norm, tied embeddings, the hourglass's norms, per-layer widths), at a small size: torch's count of one forward
    and backward equals the plan's 6 N + 12 L H Q T exactly."""
    families = {}
    for experiment in group_options("experiment"):
        for run in plan_experiment(experiment, []).runs:
            m = run.model
            if run.params is None:  # widths wait for a profile
                continue
            # K is left out: 4 to 16 sub-MLPs are one loop of the same module
            family = (m.block, m.ffn.kind, m.layer_heads is not None, m.kv_group, m.has_qk_norm, m.tie_embeddings,
                      m.hourglass_on_stream, m.ffn.sub_norm, len(set(m.ffn.widths)) > 1)
            families.setdefault(family, m)
    assert len(families) >= 8  # swiglu and hourglass, olmo2, OpenELM's heads per layer, the release's shapes
    for family, m in families.items():
        m = small(m)
        assert model_flops(m, 16, 2) == flops_per_token(m, 16), family


def test_a_graph_break_in_a_block_is_named_by_the_trace_and_fails_the_compiled_blocks_training_runs(cache,
                                                                                                     monkeypatch):
    """Training compiles each block whole (`compile_blocks`, fullgraph): a break inside one would stop a job at its
    first step, so the pre-flight traces every distinct block (the tapered arm's four widths: four traces) and names
    it; unbroken, the same model traces whole and runs compiled to the eager model's output."""
    import torch

    from study.models.transformer import Block, build_model
    from study.train.parallelize import compile_blocks
    from study.train.preflight import graph_breaks

    spec = next(r for r in plan_experiment("demo", ["cluster=local"]).runs if r.config.variant == "tapered")
    assert len(set(spec.model.ffn.widths)) == spec.model.n_layers == 4
    assert graph_breaks(spec, spec.config) == (0, [])
    model = build_model(spec.model, "cpu", seed=0)
    idx = torch.randint(0, spec.model.vocab_size, (2, 16))
    eager = model(idx)
    compile_blocks(model, backend="eager")
    torch._dynamo.reset()
    assert torch.equal(model(idx), eager)

    forward = Block.forward

    def broken(self, x, cos, sin):
        out = forward(self, x, cos, sin)
        torch._dynamo.graph_break()
        return out * 2

    monkeypatch.setattr(Block, "forward", broken)
    breaks, reasons = graph_breaks(spec, spec.config)
    assert breaks == 4 and len(reasons) == 4 and all("graph_break" in r for r in reasons)
    model = build_model(spec.model, "cpu", seed=0)
    compile_blocks(model, backend="eager")
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        model(idx)
    torch._dynamo.reset()


def test_a_second_preflight_reads_the_cache_and_a_damaged_or_stale_entry_is_measured_again(workdir, cache, capsys,
                                                                                            monkeypatch):
    args = ["preflight", "demo", "--variant", "hourglass", "cluster.tasks_per_node=2", "--json"]
    assert main(args) == 0
    [shape] = json.loads(capsys.readouterr().out)["shapes"]
    assert not shape["cached"] and len(shape["runs"]) == 6  # its three tune points and three seeds: one shape
    assert shape["layout"] == "1 node x 2 ranks, full" and shape["peak_gib"] > 0
    assert shape["flops_per_token"] == shape["plan_flops_per_token"]
    runs = plan_experiment("demo", ["cluster.tasks_per_node=2"]).runs
    spec = next(r for r in runs if r.config.variant == "hourglass")
    assert shape["estimated_peak_gib"] == run_memory(spec).peak / GIB  # the plan's estimate, shown beside it
    assert shape["peak_gib"] == pytest.approx(shape["estimated_peak_here_gib"], rel=0.1)  # and of this very step
    assert shape["graph_breaks"] == 0 and shape["break_reasons"] == []
    assert (cache / "preflight" / f"{shape['shape']}.json").is_file()

    def unwanted(*_, **__):
        raise AssertionError("a cached shape was measured again")

    monkeypatch.setattr("study.train.preflight.measure", unwanted)
    assert main(args) == 0
    [again] = json.loads(capsys.readouterr().out)["shapes"]
    assert again["cached"] and again["peak_gib"] == shape["peak_gib"] and again["shape"] == shape["shape"]
    assert not (workdir / "mlflow.db").exists() and not (workdir / "runs").exists()  # only the cache is written

    # a damaged entry is no result: the shape is measured again and its entry rewritten whole
    entry = cache / "preflight" / f"{shape['shape']}.json"
    entry.write_text(entry.read_text()[:40])
    measured = Measured(**{**{k: shape[k] for k in Measured.__dataclass_fields__}, "peak_gib": 1.5})
    monkeypatch.setattr("study.train.preflight.measure", lambda spec, trace: measured)
    assert main(args) == 0
    out, err = capsys.readouterr()
    [remeasured] = json.loads(out)["shapes"]
    assert not remeasured["cached"] and remeasured["peak_gib"] == 1.5
    assert f"{entry} is unreadable" in err
    assert json.loads(entry.read_text())["measured"]["peak_gib"] == 1.5

    # other code for the model, its layout or the step is another shape: measured, never read from the cache
    monkeypatch.setattr("study.launch.preflight._code", lambda: "edited")
    assert main(args) == 0
    [edited] = json.loads(capsys.readouterr().out)["shapes"]
    assert not edited["cached"] and edited["shape"] != shape["shape"]


def test_preflight_refuses_an_unknown_experiment(cache, capsys):
    assert main(["preflight", "no_such_experiment"]) == 2
    err = capsys.readouterr().err
    assert "no_such_experiment" in err and "Traceback" not in err
    assert not cache.exists()


def test_a_shape_that_cannot_be_stepped_stops_preflight_naming_the_run(cache, capsys, monkeypatch):
    def out_of_memory(*_, **__):
        raise RuntimeError("the step ran out of memory")

    monkeypatch.setattr("study.train.step.train_step", out_of_memory)
    assert main(["preflight", "demo", "--variant", "tapered", "--no-trace", "cluster.tasks_per_node=2"]) == 2
    err = capsys.readouterr().err
    run = next(r for r in plan_experiment("demo", ["cluster.tasks_per_node=2"]).runs if r.config.variant == "tapered")
    assert f"run {run.name} ({run.key}) cannot be stepped" in err
    assert "RuntimeError: the step ran out of memory" in err and "Fix:" in err
    assert not list((cache / "preflight").iterdir())  # nothing kept of a shape that did not step


def test_a_cache_that_cannot_hold_results_is_refused_before_anything_is_measured(cache, capsys, monkeypatch):
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text("a file where the cache folder should be")

    def unwanted(*_, **__):
        raise AssertionError("measured without a place to keep the result")

    monkeypatch.setattr("study.train.preflight.measure", unwanted)
    assert main(["preflight", "demo", "--variant", "tapered"]) == 2
    err = capsys.readouterr().err
    assert "error in `data.cache_dir`: preflight results cannot be kept in" in err and "STUDY_CACHE" in err
