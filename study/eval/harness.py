"""Downstream evaluation with lm-eval: `StudyLM` wraps a causal module `model(idx) -> logits` and its tokenizer as
an lm-eval model scoring continuations as HFLM does; `evaluate_model` runs hub tasks (`arc_easy`, ...; they download
their data) or the offline ones in `study/eval/tasks/` (`*_local`, same prompts and metrics) and names the scores
`eval/<task>/<metric>`.

CPU recipe:
    evaluate_model(model, "runs/tok/tokenizer.json", ["arc_easy_local", "piqa_local"], limit=20)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from tokenizers import Tokenizer

from study.data.tokenizer import eos_id, id_bound, load_tokenizer
from study.errors import StudyError
from study.config.tasks import LOCAL_TASK_DIR, check_tasks, local_task_names
from study.eval.hub import check_hub_data

logger = logging.getLogger(__name__)
Request = tuple[tuple[str, str] | None, list[int], list[int]]
"""lm-eval's tokenised request: the (context, continuation) strings (None for rolling windows), their tokens."""


@register_model("study")
class StudyLM(TemplateLM):
    """A causal module `model(idx) -> logits` and its tokenizer as an lm-eval model. Context/continuation splitting is
    TemplateLM's, so boundaries match HFLM's; the caller puts the module on `device` and in eval mode."""

    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, *, max_length: int, batch_size: int = 16,
                 device: str = "cpu", eos_token: str | None = None):
        super().__init__()
        if max_length < 1 or batch_size < 1:
            raise StudyError("max_length" if max_length < 1 else "batch_size",
                             f"must be at least 1, got max_length={max_length}, batch_size={batch_size}",
                             "pass positive values")
        self.model = model
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.batch_size = batch_size
        self._device = torch.device(device)
        self._eos_id = eos_id(tokenizer, eos_token, field="eos_token")

    @property
    def eot_token_id(self) -> int:
        return self._eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        # Scored text carries no template tokens; the EOS prefix for empty contexts is added by TemplateLM.
        return self.tokenizer.encode(string, add_special_tokens=False).ids

    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(sum of continuation log-probabilities, whether greedy decoding yields the continuation) per request."""
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        # Longest first, so each batch pads little and running out of memory shows up at once.
        order = sorted(range(len(requests)), key=lambda i: -(len(requests[i][1]) + len(requests[i][2])))
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            inputs = [self._input_tokens(*requests[i][1:]) for i in batch]
            idx = pad_sequence([torch.tensor(tokens, dtype=torch.long) for tokens in inputs], batch_first=True,
                               padding_value=self._eos_id)
            with torch.inference_mode():
                logprobs = F.log_softmax(self.model(idx.to(self._device)).float(), dim=-1).cpu()
            for row, i in enumerate(batch):
                strings, _, continuation = requests[i]
                end = len(inputs[row])
                # Position t predicts token t + 1: the continuation's n tokens come from the last n positions.
                scored = logprobs[row, end - len(continuation) : end]
                target = torch.tensor(continuation)
                results[i] = result = (float(scored.gather(-1, target[:, None]).sum()),
                                       bool((scored.argmax(dim=-1) == target).all()))
                if strings is not None:
                    self.cache_hook.add_partial("loglikelihood", strings, result)
        return results

    def _input_tokens(self, context: list[int], continuation: list[int]) -> list[int]:
        """Model input for one request: context + continuation minus the last token, cut from the left."""
        if len(continuation) > self.max_length:
            raise StudyError("max_length", f"a continuation of {len(continuation)} tokens is longer than "
                             f"max_length={self.max_length}",
                             "raise max_length up to the model's max_seq_len or evaluate tasks with shorter answers")
        return (context + continuation)[-(self.max_length + 1) :][:-1]

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents in max_length windows, each token predicted once (perplexity tasks)."""
        windows: list[Request] = []
        counts: list[int] = []
        for (text,) in (request.args for request in requests):
            pairs = [make_disjoint_window(pair) for pair in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            windows += [(None, context, continuation) for context, continuation in pairs]
            counts.append(len(pairs))
        scores = iter(self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm))
        totals: list[float] = []
        for request, count in zip(requests, counts, strict=True):
            totals.append(sum(next(scores)[0] for _ in range(count)))
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, totals[-1])
        return totals

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None) -> StudyLM:
        """How lm-eval's CLI builds the model (`--model_args run=KEY[,tracking_uri=URI][,runs=DIR]` or
        `checkpoint=<run dir>/checkpoints/step_N`): loaded as `study eval` does (`from_model_args`)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return from_model_args(cls, {**arg_dict, **extra})

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None) -> StudyLM:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        raise StudyError("tasks", "generation tasks (lm-eval output_type generate_until) are not supported by the "
                         "study evaluator", "evaluate multiple-choice or perplexity tasks, e.g. arc_easy, hellaswag, "
                         "piqa or their *_local versions")


MODEL_ARGS = {
    "run": "a run key", "checkpoint": "a checkpoint folder", "tracking_uri": "the MLflow store tracking the run",
    "runs": "the runs folder, default ./runs", "max_length": "context length, default the model's",
    "device": "lm-eval's --device", "batch_size": "lm-eval's --batch_size", "max_batch_size": "ignored",
}
"""What `--model_args` of the study model may hold, and what each is."""


def parse_run_key(value: Any) -> str:
    """A run key as lm-eval parsed it: an all-digit key arrives as an int (leading zeros lost: keys have 12
    characters); one shaped like a float (`1234e5678901`) cannot be recovered unquoted."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise StudyError("model_args", f"run={value!r} is not a run key", "quote the key: --model_args \"run='KEY'\"")
    return f"{value:012d}" if isinstance(value, int) else value


def from_model_args(cls, args: dict[str, Any]):
    """`cls` (StudyLM) on the run `args` names, with the tokenizer, context length and EOS token it was trained
    with; lm-eval's --device and --batch_size arrive in `args` too."""
    from study.eval.locate import find_run, open_trained, run_eos_token, run_of_checkpoint

    if unknown := sorted(set(args) - set(MODEL_ARGS)):
        raise StudyError("model_args", f"the study model takes no argument(s) {unknown}",
                         f"use {', '.join(f'{k} ({v})' for k, v in MODEL_ARGS.items())}")
    if ("run" in args) == ("checkpoint" in args):
        raise StudyError("model_args", "the study model needs exactly one of run=KEY and checkpoint=PATH",
                         "pass --model_args run=<run key> (with tracking_uri=URI or runs=DIR from another "
                         "directory) or checkpoint=<run dir>/checkpoints/step_<N>")
    if "checkpoint" in args:
        spec, ckpt = run_of_checkpoint(str(args["checkpoint"]))
    else:
        uri = args.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
        spec, ckpt = find_run(parse_run_key(args["run"]), str(args.get("runs", "runs")), uri), None
    device = str(args.get("device") or "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        # lm-eval's CLI asks for cuda unless told otherwise; its hf model falls back the same way
        logger.warning("device %s requested but CUDA is not available: scoring on the CPU", device)
        device = "cpu"
    run = open_trained(spec, ckpt, device)
    tokenizer = load_tokenizer(run.tokenizer_path)
    check_model_embeds_tokenizer(run.model, tokenizer, run.tokenizer_path)
    batch = str(args.get("batch_size", ""))
    return cls(run.model, tokenizer, max_length=int(args.get("max_length") or model_max_length(run.model, None)),
               batch_size=int(batch) if batch.isdigit() else spec.config.eval.batch_size, device=device,
               eos_token=run_eos_token(spec, run.tokenizer_path))


def model_max_length(model: torch.nn.Module, max_length: int | None) -> int:
    if max_length is not None:
        return max_length
    config_max = getattr(getattr(model, "cfg", None), "max_seq_len", None)
    if config_max is None:
        raise StudyError("max_length", f"{type(model).__name__} has no cfg.max_seq_len to take the context length "
                         "from", "pass max_length=<the context length the model was trained with>")
    return int(config_max)


def check_model_embeds_tokenizer(model: torch.nn.Module, tokenizer: Tokenizer, tokenizer_path: Path) -> None:
    """The model's embedding has a row for every id the tokenizer emits."""
    model_vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
    if model_vocab is not None and id_bound(tokenizer) > model_vocab:
        raise StudyError("tokenizer_path", f"{tokenizer_path} emits ids up to {id_bound(tokenizer) - 1} but the model "
                         f"embeds only {model_vocab}", "pass the tokenizer.json the model was trained with")


def flatten_scores(results: dict[str, Any]) -> dict[str, float]:
    """lm-eval's per-task scores (keyed `"<metric>,<filter>"`) as `eval/<task>/<metric>`, the filter appended when it
    is not `none` (stderrs as `eval/<task>/<metric>_stderr`)."""
    flat: dict[str, float] = {}
    for task, scores in results["results"].items():
        for key, value in scores.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            metric, filter_name = key.split(",", 1)
            name = metric if filter_name == "none" else f"{metric}/{filter_name}"
            flat[f"eval/{task}/{name}"] = float(value)
    return flat


def evaluate_model(model: torch.nn.Module, tokenizer_path: str | Path, tasks: Sequence[str] | str, *,
                   limit: int | float | None = None, batch_size: int = 16, device: str = "cpu", num_fewshot: int = 0,
                   max_length: int | None = None, eos_token: str | None = None) -> dict[str, Any]:
    """Score `model` with lm-eval: {"lm_eval": its results, "metrics": flatten_scores(...), "items": item_scores(...)}.

    Local tasks run offline; other names are lm-eval's built-in tasks (slow to index, data from the Hub). `limit`
    caps the documents per task (below 1: a share). The model is moved to `device` and in eval mode for the call.
    """
    names = [name.strip() for name in (tasks.split(",") if isinstance(tasks, str) else tasks) if name.strip()]
    if not names:
        raise StudyError("tasks", "no task given", "name at least one task, e.g. tasks=arc_easy_local")
    hub = check_tasks(names, index=False)  # a typo of a local task is said before anything loads
    check_hub_data(hub)  # offline, a hub task without cached data is refused before lm-eval indexes and retries
    tokenizer_path = Path(tokenizer_path)
    if not tokenizer_path.is_file():
        raise StudyError("tokenizer_path", f"{tokenizer_path} does not exist", "pass the run's tokenizer.json")
    tokenizer = load_tokenizer(tokenizer_path)
    check_model_embeds_tokenizer(model, tokenizer, tokenizer_path)
    lm = StudyLM(model.to(device), tokenizer, max_length=model_max_length(model, max_length), batch_size=batch_size,
                 device=device, eos_token=eos_token)
    was_training = model.training
    model.eval()
    try:
        manager = TaskManager(include_path=str(LOCAL_TASK_DIR), include_defaults=bool(hub))
        if hub:
            check_tasks(hub, manager=manager)
        if num_fewshot:
            check_fewshot(_quietly_load(manager, names), num_fewshot)
        try:
            # No global seeds: scoring is deterministic and a caller's (a training loop's) random streams stay
            # untouched. log_samples keeps the per-item scores the report's item-level bootstrap reads.
            results = simple_evaluate(model=lm, tasks=names, num_fewshot=num_fewshot, batch_size=batch_size,
                                      device=device, limit=limit, task_manager=manager, log_samples=True,
                                      random_seed=None, numpy_random_seed=None, torch_random_seed=None)
        except ConnectionError as error:
            raise StudyError("tasks", f"the data of hub task(s) {hub} could not be downloaded ({error})",
                             "run where the Hugging Face Hub is reachable (or with the datasets already in "
                             f"HF_DATASETS_CACHE), or use the offline local tasks "
                             f"{local_task_names(LOCAL_TASK_DIR)}") from error
    finally:
        model.train(was_training)
    items = item_scores(results.pop("samples", {}) or {})
    metrics = flatten_scores(results)
    for task, rows in items.items():
        lls = [r["ll_correct"] for r in rows if r.get("ll_correct") is not None]
        if lls:
            # far less noisy than accuracy at small scale: every item contributes, not only the argmax
            metrics[f"eval/{task}/ll_correct"] = float(sum(lls) / len(lls))
    return {"lm_eval": results, "metrics": metrics, "items": items}


def _quietly_load(manager: TaskManager, names: list[str]) -> dict[str, Any]:
    """The tasks `names` as lm-eval builds them, without datasets' progress bars (this load only counts documents)."""
    import datasets

    was_shown = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        return manager.load(names)["tasks"]
    finally:
        if was_shown:
            datasets.enable_progress_bars()


def check_fewshot(tasks: dict[str, Any], num_fewshot: int) -> None:
    """Every task has `num_fewshot` solved examples to draw per document (one fewer where they come from the scored
    split, which leaves the document out), refused by name before lm-eval's sampler fails with a bare ValueError."""
    for name, task in tasks.items():
        if task.get_config("num_fewshot") == 0:  # lm-eval keeps a task's explicit 0 whatever is asked
            continue
        pool = len(task.fewshot_docs() or [])
        available = pool - 1 if task.fewshot_cfg.split == task.config.test_split else pool
        if num_fewshot > available:
            raise StudyError("num_fewshot", f"{num_fewshot} examples per document is more than task {name} has "
                             f"({pool} documents, {available} to draw from besides the one scored)",
                             f"use num_fewshot={max(available, 0)} or fewer (0 for zero-shot), or a task with more "
                             "documents")


def item_scores(samples: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Per task, one row per scored document: doc_id, each per-item metric lm-eval logged (acc, ...), and for
    multiple-choice tasks n_choices and ll_correct (the log-likelihood of the correct choice)."""
    out: dict[str, list[dict]] = {}
    for task, rows in samples.items():
        items = []
        for sample in rows:
            row = {"doc_id": int(sample["doc_id"])}
            for name in sample.get("metrics", []):
                value = sample.get(name)
                if isinstance(value, bool | int | float):
                    row[name] = float(value)
            target, resps = sample.get("target"), sample.get("filtered_resps") or []
            if all(isinstance(r, list | tuple) for r in resps) and len(resps) > 1:
                row["n_choices"] = len(resps)
            if isinstance(target, str) and target.isdigit():
                target = int(target)
            if isinstance(target, int) and 0 <= target < len(resps) and isinstance(resps[target], list | tuple):
                row["ll_correct"] = float(resps[target][0])
            items.append(row)
        out[task] = sorted(items, key=lambda r: r["doc_id"])
    return out


def task_summary(items: dict[str, list[dict]]) -> dict[str, dict]:
    """Per task: the documents scored and the chance accuracy on them, mean 1 / choices (None without choices)."""
    summary = {}
    for task, rows in items.items():
        choices = [r["n_choices"] for r in rows if "n_choices" in r]
        chance = sum(1 / n for n in choices) / len(choices) if choices and len(choices) == len(rows) else None
        summary[task] = {"items": len(rows), "chance": chance}
    return summary
