"""Published figures: each value's source and verification read from the experiment file, malformed blocks refused
by field, and the report's comparison of the papers' deltas with ours in nats."""

from __future__ import annotations

import math
import shutil

import pytest
import yaml

from analysis.published import delta_nats, published_figures
from analysis.report import build_report
from benchmarks.synthetic_store import synthetic_store
from conftest import ROOT, new_store
from study.cli import main
from study.errors import StudyError
from study.plan.experiment import PublishedValue, load_experiment

BASE = {"baseline": "conventional", "scales": ["tiny"], "seeds": [0, 1],
        "variants": {"conventional": {"model": "conventional"}, "hourglass": {"model": "hourglass"}}}
PAPER = "arXiv 2602.06471 v1, as a summary quotes it"


@pytest.fixture
def sweeps(tmp_path, monkeypatch):
    """A copy of sweeps/ that STUDY_SWEEPS points at; write(name, published) adds an experiment file to it."""
    tree = tmp_path / "sweeps"
    shutil.copytree(ROOT / "sweeps", tree)
    monkeypatch.setenv("STUDY_SWEEPS", str(tree))

    def write(name: str, published) -> str:
        (tree / "experiment" / f"{name}.yaml").write_text(yaml.safe_dump({**BASE, "published": published}))
        return name

    return write


def test_a_perplexity_ratio_is_the_loss_delta_in_nats():
    # perplexity is exp(mean loss): the log of a ratio of perplexities is the difference of the losses
    assert delta_nats("val/ppl", math.exp(3.25), math.exp(3.5)) == pytest.approx(-0.25, abs=1e-12)
    assert delta_nats("val/loss", 3.430, 3.449) == pytest.approx(-0.019, abs=1e-12)


def test_shipped_published_values_name_their_source_and_none_of_them_is_verified():
    hourglass = load_experiment("hourglass").published
    assert hourglass.metric == "val/ppl"
    assert {s: {v: x.value for v, x in at.items()} for s, at in hourglass.values.items()} == {
        "113M": {"conventional": 36.441, "hourglass_fixed": 36.179, "hourglass_attn": 35.101},
        "1B": {"conventional": 20.002, "olmo2": 20.466}}
    # PAPERS.md: the paper body could not be read, the numbers come from summaries of its first version
    values = [x for at in hourglass.values.values() for x in at.values()]
    assert all(not x.verified and x.source.startswith("arXiv 2602.06471 v1") for x in values)
    geometry = load_experiment("geometry").published
    assert geometry.metric == "val/loss"
    # the paper's anti-topological/raw control is not the design of our `anti` (the mirrored schedule): no target
    assert {v: x.value for v, x in geometry.values["440M"].items()} == {"uniform": 3.449, "cosine": 3.446,
                                                                         "geometry": 3.430}
    assert not any(x.verified for x in geometry.values["440M"].values())


def test_the_older_flat_form_still_reads_with_the_block_source_as_unverified(sweeps):
    name = sweeps("flat", {"source": PAPER, "metric": "val/ppl", "values": {"tiny": {"conventional": 36.441,
                                                                                     "hourglass": 36.179}}})
    assert load_experiment(name).published.values == {"tiny": {
        "conventional": PublishedValue(36.441, PAPER, False), "hourglass": PublishedValue(36.179, PAPER, False)}}
    # a value of the new form may lean on the block's source too, and says itself whether it was verified
    name = sweeps("mixed", {"source": PAPER, "metric": "val/loss", "values": {"tiny": {
        "conventional": {"value": 3.5, "verified": True},
        "hourglass": {"value": 3.4, "source": "release", "verified": False}}}})
    assert load_experiment(name).published.values["tiny"] == {
        "conventional": PublishedValue(3.5, PAPER, True), "hourglass": PublishedValue(3.4, "release", False)}


def _value(value=36.441, **changes):
    return {"value": value, "source": PAPER, "verified": False, **changes}


BAD_BLOCKS = {
    "no_metric": ({"values": {"tiny": {"conventional": _value()}}}, "published.metric"),
    "accuracy_metric": ({"metric": "eval/piqa/acc", "values": {"tiny": {"conventional": _value()}}},
                        "published.metric"),
    "unknown_key": ({"metric": "val/ppl", "notes": "x", "values": {"tiny": {"conventional": _value()}}},
                    "published.notes"),
    "no_values": ({"metric": "val/ppl"}, "published.values"),
    "unknown_scale": ({"metric": "val/ppl", "values": {"113M": {"conventional": _value()}}}, "published.values.113M"),
    "unknown_variant": ({"metric": "val/ppl", "values": {"tiny": {"conventional": _value(), "hourglas": _value()}}},
                        "published.values.tiny.hourglas"),
    "no_baseline": ({"metric": "val/ppl", "values": {"tiny": {"hourglass": _value()}}}, "published.values.tiny"),
    "flat_without_source": ({"metric": "val/ppl", "values": {"tiny": {"conventional": 36.441}}},
                            "published.values.tiny.conventional"),
    "no_verified": ({"metric": "val/ppl", "values": {"tiny": {"conventional": {"value": 36.4, "source": PAPER}}}},
                    "published.values.tiny.conventional.verified"),
    "verified_as_text": ({"metric": "val/ppl", "values": {"tiny": {"conventional": _value(verified="no")}}},
                         "published.values.tiny.conventional.verified"),
    "no_source": ({"metric": "val/ppl", "values": {"tiny": {"conventional": {"value": 36.4, "verified": False}}}},
                  "published.values.tiny.conventional.source"),
    "value_as_text": ({"metric": "val/ppl", "values": {"tiny": {"conventional": _value("36.4")}}},
                      "published.values.tiny.conventional.value"),
    "zero_perplexity": ({"metric": "val/ppl", "values": {"tiny": {"conventional": _value(0.0)}}},
                        "published.values.tiny.conventional.value"),
    "unknown_value_key": ({"metric": "val/ppl", "values": {"tiny": {"conventional": _value(table=2)}}},
                          "published.values.tiny.conventional.table"),
}


@pytest.mark.parametrize("case", sorted(BAD_BLOCKS))
def test_a_malformed_published_block_is_refused_naming_the_field(case, sweeps):
    block, field = BAD_BLOCKS[case]
    name = sweeps(case, block)
    with pytest.raises(StudyError) as err:
        load_experiment(name)
    assert err.value.field == f"{name}.yaml: {field}" and err.value.fix
    # the report does not drop it silently either: a block it cannot read is the user's error
    with pytest.raises(StudyError):
        published_figures(name)


def test_the_cli_refuses_a_malformed_block_in_one_paragraph(sweeps, capsys):
    name = sweeps("bad", {"metric": "val/ppl", "values": {"tiny": {"conventional": {"value": 36.4, "source": PAPER}}}})
    assert main(["plan", name]) == 2
    err = capsys.readouterr().err
    assert "published.values.tiny.conventional.verified`" in err and "Fix:" in err and "Traceback" not in err


@pytest.mark.integration
def test_report_compares_the_papers_perplexity_ratios_with_our_loss_deltas_in_nats(tmp_path):
    uri = new_store(tmp_path / "mlflow.db")
    fixed, attn = math.log(36.179 / 36.441), math.log(35.101 / 36.441)
    # our hourglass_fixed lands on the paper's effect, our hourglass_attn is worse than conventional
    synthetic_store(uri, "hourglass", ["conventional", "hourglass_fixed", "hourglass_attn"], ["113M"], seeds=5,
                    steps=20, eval_tasks=(), baseline="conventional",
                    effects={"conventional": 0.0, "hourglass_fixed": fixed, "hourglass_attn": 0.05},
                    seed_sd=0.02, run_sd=0.002)
    result = build_report("hourglass", tracking_uri=uri, out_dir=tmp_path / "reports", n_resamples=99,
                          log_to_mlflow=False)
    rows = {p["variant"]: p for p in result["published"]}
    assert set(rows) == {"hourglass_fixed", "hourglass_attn"}  # 1B was not run: nothing to compare there
    assert rows["hourglass_fixed"]["paper_delta_nats"] == pytest.approx(fixed, rel=1e-12)
    assert rows["hourglass_attn"]["paper_delta_nats"] == pytest.approx(attn, rel=1e-12)
    losses = {r["variant"]: r for r in result["results"] if r["metric"] == "val/loss"}
    for variant, p in rows.items():  # our side is the report's own paired val/loss result, never val/ppl
        ours = losses[variant]
        assert (p["ours"], p["ci_low"], p["ci_high"], p["n"]) == (
            ours["mean_delta"], ours["ci_low"], ours["ci_high"], ours["n"])
        assert p["consistent"] == (ours["ci_low"] <= p["paper_delta_nats"] <= ours["ci_high"])
        assert p["variant_source"] == p["baseline_source"] == PAPER
        assert (p["verified"], p["baseline_verified"], p["variant_verified"]) == (False, False, False)
    assert rows["hourglass_fixed"]["consistent"] is True and rows["hourglass_attn"]["consistent"] is False
    text = (tmp_path / "reports" / "hourglass" / "report.md").read_text()
    section = text[text.index("## Published figures beside ours, as deltas in nats"):]
    assert "come from another corpus and tokenizer, so they are not compared with ours" in section
    assert f"| 113M | hourglass_attn | 36.441 → 35.101 (val/ppl) | {attn:+.4f} | {PAPER} | no |" in section
