"""lm-eval on the project's model: continuation scoring, the shipped local tasks, and task-name errors.

Everything runs lm-eval's real code path offline on the tasks in study/eval/tasks/, with tiny torch models whose
scores are known in advance and a byte-level BPE trained here on the tasks' own text.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from study.errors import StudyError
from study.eval.harness import LOCAL_TASK_DIR, StudyLM, evaluate_model, local_task_names, task_summary

LOCAL_TASKS = ["arc_easy_local", "hellaswag_local", "piqa_local", "sciq_local"]
EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    texts = [line for path in sorted(LOCAL_TASK_DIR.glob("*.jsonl")) for line in path.read_text().splitlines()]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_path: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_path))


@pytest.fixture(scope="module")
def questions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[str, list[str], int]]]:
    """Per local task, each document as lm-eval builds it: (prompt, continuations with delimiter, gold index).
    Loaded from another working directory than the repository's: the shipped YAMLs find their data themselves."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("elsewhere"))
        tasks = TaskManager(include_path=str(LOCAL_TASK_DIR), include_defaults=False).load(LOCAL_TASKS)["tasks"]
    return {
        name: [
            (
                task.doc_to_text(doc),
                [task.config.target_delimiter + choice for choice in task.doc_to_choice(doc)],
                task.doc_to_target(doc),
            )
            for doc in task.eval_docs
        ]
        for name, task in tasks.items()
    }


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


class AnswerKey(torch.nn.Module):
    """Puts almost all probability on the next token of the gold prompt+answer that starts with the input so far."""

    def __init__(self, gold_sequences: list[list[int]], vocab_size: int, max_seq_len: int):
        super().__init__()
        self.cfg = SimpleNamespace(max_seq_len=max_seq_len, vocab_size=vocab_size)
        self.vocab_size = vocab_size
        self.next_token = {tuple(seq[: t + 1]): seq[t + 1] for seq in gold_sequences for t in range(len(seq) - 1)}

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*idx.shape, self.vocab_size)
        for b, row in enumerate(idx.tolist()):
            for t in range(len(row)):
                if (token := self.next_token.get(tuple(row[: t + 1]))) is not None:
                    logits[b, t, token] = 30.0
        return logits


class Uniform(torch.nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*idx.shape, self.vocab_size)


class PrefixSum(torch.nn.Module):
    """A causal model whose every logit depends on the whole prefix, so any off-by-one in scoring shows."""

    def __init__(self, vocab_size: int):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(vocab_size, 16, generator=generator))
        self.out = torch.nn.Parameter(torch.randn(16, vocab_size, generator=generator))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.embed[idx].cumsum(dim=1) @ self.out


class Bigram(torch.nn.Module):
    """Logits depend only on the current token: a document's log-likelihood does not depend on windowing."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab_size, vocab_size, generator=torch.Generator().manual_seed(1)))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.table[idx]


def sciq_choices(doc: dict) -> list[str]:
    """SciQ's answer order (lm-eval's sciq): the three distractors, then the correct answer."""
    return [doc["distractor1"], doc["distractor2"], doc["distractor3"], doc["correct_answer"]]


def test_shipped_tasks_are_multiple_choice_documents_with_one_valid_gold_answer():
    assert local_task_names(LOCAL_TASK_DIR) == LOCAL_TASKS
    # per task: choices, gold index, number of choices, the gold positions its format uses
    shapes = {
        "arc_easy_local": (lambda d: d["choices"]["text"], lambda d: d["choices"]["label"].index(d["answerKey"]), 4,
                           {0, 1, 2, 3}),
        "hellaswag_local": (lambda d: d["endings"], lambda d: d["label"], 4, {0, 1, 2, 3}),
        "piqa_local": (lambda d: [d["sol1"], d["sol2"]], lambda d: d["label"], 2, {0, 1}),
        "sciq_local": (sciq_choices, lambda d: 3, 4, {3}),  # SciQ puts the correct answer last, always
    }
    for name, (choices_of, gold_of, n_choices, positions) in shapes.items():
        docs = [json.loads(line) for line in (LOCAL_TASK_DIR / f"{name}.jsonl").read_text().splitlines()]
        assert 40 <= len(docs) <= 60
        golds = [gold_of(doc) for doc in docs]
        assert set(golds) == positions, "every answer position of the format is used"
        for doc in docs:
            choices = choices_of(doc)
            assert len(choices) == n_choices
            # No answer is the start of another: then a longer answer can never win on a shared prefix alone.
            assert not any(a != b and b.startswith(a) for a in choices for b in choices), choices


@pytest.mark.integration
def test_model_that_knows_the_answers_scores_one_on_every_local_task(tokenizer, tokenizer_path, questions):
    gold = [
        ids(tokenizer, prompt + continuations[answer])
        for docs in questions.values()
        for prompt, continuations, answer in docs
    ]
    model = AnswerKey(gold, tokenizer.get_vocab_size(), max_seq_len=256)
    out = evaluate_model(model, tokenizer_path, LOCAL_TASKS, batch_size=8)
    assert {k: v for k, v in out["metrics"].items() if not k.endswith("/ll_correct")} == pytest.approx(
        {f"eval/{task}/{metric}": value for task in LOCAL_TASKS for metric, value in
         [("acc", 1.0), ("acc_stderr", 0.0), ("acc_norm", 1.0), ("acc_norm_stderr", 0.0)]}
    )
    assert out["lm_eval"]["n-samples"]["piqa_local"]["effective"] == 48


def test_uniform_model_scores_the_exact_chance_level_of_the_data(tokenizer, tokenizer_path, questions):
    """Uniform logits give each answer -n_tokens * log V: acc picks the fewest tokens, acc_norm the fewest per
    character, and numpy's argmax takes the first choice on ties. That is chance for this data and tokenizer."""
    expected, per_item = {}, {}
    log_v = math.log(tokenizer.get_vocab_size())
    for task, docs in questions.items():
        acc, acc_norm, ll = [], [], []
        for prompt, continuations, answer in docs:
            n_tokens = np.array(
                [len(ids(tokenizer, prompt + c)) - len(ids(tokenizer, prompt)) for c in continuations], dtype=float
            )
            n_chars = np.array([len(c) - 1 for c in continuations], dtype=float)
            acc.append(np.argmax(-n_tokens) == answer)
            acc_norm.append(np.argmax(-n_tokens / n_chars) == answer)
            ll.append(-n_tokens[answer] * log_v)
        expected[f"eval/{task}/acc"] = float(np.mean(acc))
        expected[f"eval/{task}/acc_norm"] = float(np.mean(acc_norm))
        expected[f"eval/{task}/ll_correct"] = float(np.mean(ll))
        per_item[task] = (acc, ll)
    model = Uniform(tokenizer.get_vocab_size())
    out = evaluate_model(model, tokenizer_path, LOCAL_TASKS, max_length=256)
    metrics = out["metrics"]
    # accuracies exactly; log-likelihoods to the float32 log-softmax they come from
    assert {key: metrics[key] for key in expected} == pytest.approx(expected, rel=1e-6)
    assert {k: metrics[k] for k in expected if "/acc" in k} == pytest.approx(
        {k: v for k, v in expected.items() if "/acc" in k}, abs=1e-12)
    # the per-item rows the report bootstraps over: one per document, in document order
    for task, (acc, ll) in per_item.items():
        rows = out["items"][task]
        assert [r["doc_id"] for r in rows] == list(range(len(acc)))
        assert [r["acc"] for r in rows] == [float(a) for a in acc]
        assert [r["ll_correct"] for r in rows] == pytest.approx(ll, rel=1e-6)
        assert [r["n_choices"] for r in rows] == [len(continuations) for _, continuations, _ in questions[task]]
    assert 0.0 < expected["eval/arc_easy_local/acc"] < 0.5
    # item counts and chance levels, from the raw documents: ARC-Easy, HellaSwag and SciQ have 4 choices, PIQA 2
    raw = {task: [json.loads(line) for line in (LOCAL_TASK_DIR / f"{task}.jsonl").read_text().splitlines()]
           for task in LOCAL_TASKS}
    n_choices = {"arc_easy_local": lambda d: len(d["choices"]["text"]), "hellaswag_local": lambda d: len(d["endings"]),
                 "piqa_local": lambda d: 2, "sciq_local": lambda d: len(sciq_choices(d))}
    assert task_summary(out["items"]) == {
        task: {"items": len(docs), "chance": pytest.approx(np.mean([1 / n_choices[task](d) for d in docs]))}
        for task, docs in raw.items()}
    assert task_summary(out["items"])["piqa_local"]["chance"] == 0.5


@torch.no_grad()
def continuation_logprob(model: torch.nn.Module, context: list[int], continuation: list[int],
                         max_length: int = 256) -> float:
    """log p(continuation | context) from the model's log-softmax, the input cut from the left to max_length."""
    tokens = (context + continuation)[-(max_length + 1) :]
    logprobs = F.log_softmax(model(torch.tensor([tokens[:-1]])), dim=-1)[0]
    n = len(continuation)
    return sum(float(logprobs[len(tokens) - 1 - n + k, token]) for k, token in enumerate(continuation))


def test_loglikelihood_equals_log_softmax_of_the_continuation_tokens(tokenizer):
    model = PrefixSum(tokenizer.get_vocab_size())
    eos = tokenizer.token_to_id(EOS)
    long_context = "A boy pulls a rake across the lawn and gathers the fallen leaves into a large pile. He"

    direct = functools.partial(continuation_logprob, model)

    prompt = "Question: What do bees collect from flowers to make honey?\nAnswer:"
    prompt_ids, long_ids = ids(tokenizer, prompt), ids(tokenizer, long_context)
    answer = ids(tokenizer, prompt + " nectar")[len(prompt_ids) :]
    ending = ids(tokenizer, long_context + " rakes the leaves.")[len(long_ids) :]
    requests_and_expected = [
        ((prompt, " nectar"), direct(prompt_ids, answer)),
        # The trailing space moves to the continuation: the same tokens and score as above.
        ((prompt + " ", "nectar"), direct(prompt_ids, answer)),
        # An empty context scores the continuation after EOS.
        (("", "Store it in a sealed bag."), direct([eos], ids(tokenizer, "Store it in a sealed bag."))),
        ((long_context, " rakes the leaves."), direct(long_ids, ending)),
    ]
    requests, expected = (list(column) for column in zip(*requests_and_expected))
    lm = StudyLM(model, tokenizer, max_length=256, batch_size=2)
    instances = [Instance("loglikelihood", {}, request, i) for i, request in enumerate(requests)]
    scores = [logprob for logprob, _ in lm.loglikelihood(instances, disable_tqdm=True)]
    assert scores == pytest.approx(expected, rel=1e-5)

    short = StudyLM(model, tokenizer, max_length=8, batch_size=2)
    [(truncated, _)] = short.loglikelihood(instances[3:], disable_tqdm=True)
    assert len(ending) <= 8 < len(long_ids), "the request is cut from the left, inside its context"
    assert truncated == pytest.approx(direct(long_ids, ending, max_length=8), rel=1e-5)
    assert truncated != pytest.approx(expected[3], rel=1e-3)


@pytest.mark.integration
def test_sciq_local_scores_like_lm_evals_sciq_on_the_support_passage_and_question(tokenizer, tokenizer_path):
    """acc and acc_norm of sciq_local equal the argmax comparisons of log-likelihoods computed here from the raw
    documents with lm-eval sciq's prompt (support passage, question, "Answer:") and answer order (gold last)."""
    model = PrefixSum(tokenizer.get_vocab_size())
    docs = [json.loads(line) for line in (LOCAL_TASK_DIR / "sciq_local.jsonl").read_text().splitlines()]
    acc, acc_norm, ll_correct = [], [], []
    for doc in docs:
        prompt = f"{doc['support'].lstrip()}\nQuestion: {doc['question']}\nAnswer:"
        context = ids(tokenizer, prompt)
        choices = sciq_choices(doc)
        # lm-eval splits prompt + " " + choice after the prompt's own tokens
        ll = np.array([continuation_logprob(model, context, ids(tokenizer, f"{prompt} {c}")[len(context):])
                       for c in choices])
        acc.append(float(np.argmax(ll) == 3))
        acc_norm.append(float(np.argmax(ll / np.array([len(c) for c in choices])) == 3))
        ll_correct.append(ll[3])
    out = evaluate_model(model, tokenizer_path, ["sciq_local"], max_length=256, batch_size=8)
    rows = out["items"]["sciq_local"]
    assert [r["acc"] for r in rows] == acc and [r["acc_norm"] for r in rows] == acc_norm
    assert [r["ll_correct"] for r in rows] == pytest.approx(ll_correct, rel=1e-5)
    assert out["metrics"]["eval/sciq_local/acc"] == pytest.approx(np.mean(acc), abs=1e-12)
    assert out["metrics"]["eval/sciq_local/acc_norm"] == pytest.approx(np.mean(acc_norm), abs=1e-12)
    assert task_summary(out["items"])["sciq_local"] == {"items": 40, "chance": 0.25}
    assert 0 < np.mean(acc) < 1, "the comparison tells right from wrong answers"


def test_greedy_flag_is_true_only_when_argmax_yields_the_continuation(tokenizer):
    prompt = "Question: Which planet is closest to the Sun?\nAnswer:"
    gold = ids(tokenizer, prompt + " Mercury")
    lm = StudyLM(AnswerKey([gold], tokenizer.get_vocab_size(), 64), tokenizer, max_length=64)
    requests = [Instance("loglikelihood", {}, (prompt, answer), i) for i, answer in enumerate([" Mercury", " Mars"])]
    (_, mercury_greedy), (_, mars_greedy) = lm.loglikelihood(requests, disable_tqdm=True)
    assert (mercury_greedy, mars_greedy) == (True, False)


def test_rolling_loglikelihood_predicts_every_token_exactly_once_across_windows(tokenizer):
    model = Bigram(tokenizer.get_vocab_size())
    text = " ".join(json.loads(line)["goal"] for line in (LOCAL_TASK_DIR / "piqa_local.jsonl").read_text().splitlines()[:4])
    tokens = [tokenizer.token_to_id(EOS)] + ids(tokenizer, text)
    logprobs = F.log_softmax(model.table.detach(), dim=-1)
    expected = sum(float(logprobs[a, b]) for a, b in zip(tokens[:-1], tokens[1:]))
    lm = StudyLM(model, tokenizer, max_length=8, batch_size=3)
    assert len(tokens) > 4 * 8, "several windows"
    (total,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    assert total == pytest.approx(expected, rel=1e-5)
    assert math.isfinite(total)


def test_limit_caps_the_documents_scored_per_task(tokenizer_path, tokenizer):
    out = evaluate_model(Uniform(tokenizer.get_vocab_size()), tokenizer_path, "piqa_local,arc_easy_local",
                         limit=5, max_length=64)
    assert {task: n["effective"] for task, n in out["lm_eval"]["n-samples"].items()} == {
        "piqa_local": 5, "arc_easy_local": 5
    }


def test_generation_tasks_are_refused_with_a_study_error(tokenizer):
    lm = StudyLM(Uniform(tokenizer.get_vocab_size()), tokenizer, max_length=16)
    with pytest.raises(StudyError, match="generation tasks"):
        lm.generate_until([Instance("generate_until", {}, ("Question:", {"until": ["\n"]}), 0)])


def test_model_without_max_seq_len_needs_max_length(tokenizer_path, tokenizer):
    with pytest.raises(StudyError, match="max_length"):
        evaluate_model(Uniform(tokenizer.get_vocab_size()), tokenizer_path, ["piqa_local"])


def test_misspelled_local_task_is_a_study_error_naming_the_local_tasks(tokenizer_path, tokenizer):
    with pytest.raises(StudyError, match="arc_easy_local") as error:
        evaluate_model(Uniform(tokenizer.get_vocab_size()), tokenizer_path, ["arc_hard_local"], max_length=16)
    assert error.value.field == "tasks"
    assert "arc_hard_local" in error.value.problem


@pytest.mark.integration
def test_unknown_hub_task_is_a_study_error_that_says_hub_tasks_need_network(tokenizer_path, tokenizer):
    with pytest.raises(StudyError, match="need network") as error:
        evaluate_model(Uniform(tokenizer.get_vocab_size()), tokenizer_path, ["piqa_local", "no_such_task"],
                       max_length=16)
    assert "no_such_task" in error.value.problem and "piqa_local" in error.value.fix


def test_model_args_recover_a_run_key_that_lm_eval_parsed_as_a_number():
    from study.eval.harness import parse_run_key

    # lm-eval turns an all-digit value into an int, dropping leading zeros; keys are 12 characters
    assert parse_run_key(12345) == "000000012345" and parse_run_key("0a1b2c3d4e5f") == "0a1b2c3d4e5f"
    with pytest.raises(StudyError, match="quote the key"):
        parse_run_key(1.234e60)  # `1234e5678901` read as a float cannot be told apart from other keys


def test_model_args_the_study_model_does_not_take_are_refused_by_name():
    with pytest.raises(StudyError, match=r"no argument\(s\) \['pretrained'\]") as error:
        StudyLM.create_from_arg_string("pretrained=gpt2")
    assert error.value.field == "model_args" and "run (a run key)" in error.value.fix


@pytest.mark.integration
def test_the_study_model_is_an_lm_eval_plugin_entry_point_which_this_lm_eval_release_does_not_read():
    """pyproject.toml registers `study` under lm-eval's `lm_eval.models` entry-point group. lm-eval 0.4.13 looks
    models up in its own table only: a fresh process that has not imported study answers "no model for this name"
    (hence `python -m study.eval`). Its registry does take lazy placeholders: the entry point's value as a
    "module:attr" string resolves to StudyLM, while the EntryPoint object itself breaks when the decorated class
    registers over it (the upgrade lm-eval's plugin support added after 0.4.13)."""
    import subprocess
    import sys
    from importlib.metadata import entry_points

    (found,) = [e for e in entry_points(group="lm_eval.models") if e.name == "study"]
    assert found.value == "study.eval.harness:StudyLM" and found.load() is StudyLM
    probe = """
import sys
from importlib.metadata import entry_points
from lm_eval.api.registry import get_model, model_registry

def outcome(target):
    try:
        get_model("study")
        return "resolved"
    except ValueError:
        return "unknown"
    except AttributeError:
        return "broke"

print(outcome(None), "study.eval.harness" in sys.modules)
(ep,) = [e for e in entry_points(group="lm_eval.models") if e.name == "study"]
model_registry.register("study", target=ep)
print(outcome(ep))
model_registry._objs.pop("study", None)
sys.modules.pop("study.eval.harness", None)
model_registry.register("study", target=ep.value)
cls = get_model("study")
print(cls.__module__ + ":" + cls.__qualname__)
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    if out[0] == "resolved":  # a release that reads the group: `--model study` works without the wrapper
        assert out[1] == "True", "the registry found the model without importing it through the entry point"
        return
    assert out == ["unknown", "False", "broke", "study.eval.harness:StudyLM"]


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("offline", ["HF_HUB_OFFLINE", "connection refused"])
def test_a_hub_task_without_its_data_offline_is_refused_by_name_before_lm_eval_indexes_or_retries(
        tokenizer_path, tokenizer, tmp_path, monkeypatch, offline):
    import time

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty Hugging Face cache
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(name, raising=False)
    if offline == "HF_HUB_OFFLINE":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        why = "this process is told not to reach (HF_HUB_OFFLINE=1)"
    else:
        endpoint = f"http://127.0.0.1:{_closed_port()}"
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        why = f"does not answer at {endpoint} ("
    start = time.monotonic()
    with pytest.raises(StudyError) as error:
        evaluate_model(Uniform(tokenizer.get_vocab_size()), tokenizer_path, ["arc_easy", "piqa_local"], max_length=16)
    assert time.monotonic() - start < 5  # lm-eval's index alone takes about 10 s, its download retries 14 more
    assert error.value.field == "tasks"
    assert error.value.problem.startswith("hub task(s) ['arc_easy'] need data from the Hugging Face Hub, which ")
    assert why in error.value.problem and "(arc_easy: allenai/ai2_arc (ARC-Easy))" in error.value.problem
    assert "tasks=arc_easy_local" in error.value.fix and "HF_HUB_OFFLINE=1" in error.value.fix
    assert "datasets.load_dataset('allenai/ai2_arc', 'ARC-Easy')" in error.value.fix


def test_a_hub_task_whose_data_is_cached_passes_the_offline_check(tmp_path, monkeypatch):
    from study.eval.hub import check_hub_data, hub_dataset

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(name, raising=False)
    assert hub_dataset("arc_easy") == ("allenai/ai2_arc", "ARC-Easy")
    assert hub_dataset("hellaswag") == ("Rowan/hellaswag", None)
    with pytest.raises(StudyError, match="hellaswag"):
        check_hub_data(["arc_easy", "hellaswag"])
    (tmp_path / "hf" / "hub" / "datasets--allenai--ai2_arc").mkdir(parents=True)  # downloaded once, online
    (tmp_path / "hf" / "datasets" / "Rowan___hellaswag").mkdir(parents=True)  # prepared by `datasets`
    check_hub_data(["arc_easy", "hellaswag", "piqa_local"])


def test_study_eval_of_a_hub_task_offline_exits_2_naming_it_before_the_checkpoint_loads(workdir, tmp_path,
                                                                                       monkeypatch, capsys):
    from conftest import TINY
    from study.cli import main
    from study.config.spec import write_spec
    from study.plan.planner import select_run

    spec = select_run([*TINY, "experiment=offline"])
    write_spec(spec)  # planned, never trained: no checkpoint to load
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["eval", spec.key, "tasks=arc_easy,piqa"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("study eval: error in `tasks`: hub task(s) ['arc_easy', 'piqa'] need data from the Hugging "
                          "Face Hub, which this process is told not to reach (HF_HUB_OFFLINE=1)"), err
    assert "Fix: use the shipped offline tasks" in err and "tasks=arc_easy_local,piqa_local" in err
    assert not spec.run_dir.evals.exists()
