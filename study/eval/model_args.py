"""lm-eval's `--model_args run=KEY,...` for the `study` model, turned into a run loaded as `study eval` loads it."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from study.errors import StudyError

logger = logging.getLogger(__name__)

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
    from study.data.tokenizer import load_tokenizer
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
    from study.data.tokenizer import id_bound

    model_vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
    if model_vocab is not None and id_bound(tokenizer) > model_vocab:
        raise StudyError("tokenizer_path", f"{tokenizer_path} emits ids up to {id_bound(tokenizer) - 1} but the model "
                         f"embeds only {model_vocab}", "pass the tokenizer.json the model was trained with")
