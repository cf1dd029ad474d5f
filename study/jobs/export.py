"""`study export RUN_KEY --format hf`: a trained run's latest checkpoint as a directory other tools read.

A model a transformers class computes (llama or olmo2 block, uniform SwiGLU) becomes `config.json`,
`model.safetensors` and the tokenizer files, which transformers, lm-eval's `hf` model and vLLM load; any other is
written in the study format (`study.export`). Every export also holds `study_export.json` (run key,
checkpoint, dtype, run spec). Loading the DCP checkpoint into one unsharded model consolidates it whatever world size
trained it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from study.config.spec import RunSpec
from study.errors import StudyError
from study.export.hf import hf_architecture, hf_unsupported, padded_units, save_pretrained
from study.export import MANIFEST, WEIGHTS

FORMATS = ("hf",)
DTYPES = {"auto": None, "fp32": "float32", "bf16": "bfloat16"}
"""--dtype choices; `auto` is what the run computed in (its checkpoint records it)."""


@dataclass(frozen=True)
class Exported:
    path: Path
    """The export directory."""
    format: str
    """`hf` (a transformers class reads it) or `study` (read it with `study.export.load`)."""
    architecture: str | None
    """The transformers class, for the hf format."""
    why_study: str | None
    """What no transformers class expresses, for the study format."""
    dtype: str
    """dtype of the stored weights."""
    dtype_reason: str
    """Why that dtype."""
    step: int
    """The checkpoint's training step."""
    padded_units: dict[int, int]
    """Zero FFN hidden units added per layer to give the hf format one width (exact: `padded_units`)."""


def check_options(fmt: str, dtype: str) -> None:
    """The options, checked before the run is looked up."""
    if fmt not in FORMATS:
        raise StudyError("--format", f"{fmt!r} is not an export format", f"use --format {' or '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise StudyError("--dtype", f"{dtype!r} is not an export dtype", f"use --dtype {', '.join(DTYPES)}")
    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as err:
        raise StudyError("--format", f"the {fmt} export needs transformers and safetensors ({err})",
                         "install them: pip install -e '.[hf]'") from None


def export_run(spec: RunSpec, fmt: str = "hf", out: str | Path | None = None, force: bool = False,
               dtype: str = "auto") -> Exported:
    """Write the run's latest complete checkpoint to `out` (default `<run dir>/export`); every input is checked
    before anything is written, and the directory appears whole or not at all."""
    import torch

    from study.config.secrets import redact
    from study.data.tokenizer import eos_id, id_bound, load_tokenizer
    from study.eval.locate import load_trained_model, run_eos_token, run_tokenizer
    from study.train.state import TrainState

    check_options(fmt, dtype)
    out = Path(out).resolve() if out else spec.run_dir.export
    if out.exists() and not out.is_dir():
        raise StudyError("--out", f"{out} is a file", "give a directory path (it is created)")
    if out == spec.run_dir.path or out in spec.run_dir.path.parents:
        raise StudyError("--out", f"{out} holds the run directory {spec.run_dir.path}",
                         "give a directory outside it (the default is <run dir>/export)")
    earlier = None
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise StudyError("--out", f"{out} exists and is not empty",
                             "add --force to replace an earlier export, or choose another --out")
        earlier = _earlier_files(out)
    model, ckpt = load_trained_model(spec)
    state = TrainState.read(ckpt / "train_state.json")
    weights_dtype, reason = _weights_dtype(dtype, state.compute_dtype, spec.config.train.precision)
    tokenizer_path = run_tokenizer(spec)  # the one the run trained with, as evaluation reads it: never the data
    tok = load_tokenizer(tokenizer_path)
    vocab_size, end_id = id_bound(tok), eos_id(tok, run_eos_token(spec, tokenizer_path))
    if vocab_size > spec.model.vocab_size:
        raise StudyError("data.tokenizer", f"the run's tokenizer emits {vocab_size} ids but the model embeds "
                         f"{spec.model.vocab_size}", "export a run whose model.vocab_size covers its tokenizer")

    architecture, why_study = hf_architecture(spec.model), hf_unsupported(spec.model)
    exported = Exported(out.resolve(), "hf" if architecture else "study", architecture, why_study, weights_dtype,
                        reason, state.step, padded_units(spec.model) if architecture else {})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:  # transformers and safetensors are imported once check_options has said whether they are installed
        from safetensors.torch import save_model
        from transformers import PreTrainedTokenizerFast

        # tokenizer.json and tokenizer_config.json, EOS as the run uses it (also BOS: see `hf_config`)
        hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path), model_max_length=spec.model.max_seq_len)
        eos = hf_tok.convert_ids_to_tokens(end_id)
        hf_tok.eos_token = hf_tok.bos_token = eos
        hf_tok.save_pretrained(tmp)
        # transformers 5 names its class TokenizersBackend; PreTrainedTokenizerFast is the name 4.x and 5 both resolve
        path = tmp / "tokenizer_config.json"
        written = json.loads(path.read_text()) | {"tokenizer_class": "PreTrainedTokenizerFast"}
        path.write_text(json.dumps(written, indent=2) + "\n")
        if architecture:
            save_pretrained(model, tmp, end_id, weights_dtype)
        else:  # our own names (the model cast in place): a tied head is stored once, and `load_model` re-ties it
            save_model(model.to(getattr(torch, weights_dtype)), str(tmp / WEIGHTS), metadata={"format": "pt"})
        record = {"format": exported.format, "architecture": architecture, "why_study": why_study,
                  "loader": "transformers.AutoModelForCausalLM" if architecture else "study.export.load",
                  "run_key": spec.key, "name": spec.name, "checkpoint": ckpt.name, "step": exported.step,
                  "dtype": weights_dtype, "dtype_reason": reason, "padded_units": exported.padded_units,
                  "eos_token": eos, "files": sorted([p.name for p in tmp.iterdir()] + [MANIFEST]),
                  "spec": redact(spec.as_dict())}
        (tmp / MANIFEST).write_text(json.dumps(record, indent=1, default=str))
        if earlier is None:
            os.replace(tmp, out)  # a new or empty directory: the export appears whole
        else:
            _replace_files(tmp, out, earlier)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return exported


def _earlier_files(out: Path) -> list[str]:
    """The files of the earlier export in `out`, as its manifest lists them: all that --force removes. An export
    whose manifest lists none (written before manifests did) loses only the files the new one writes over."""
    try:
        listed = json.loads((out / MANIFEST).read_text()).get("files", [])
    except FileNotFoundError:  # --force replaces exports only, never a folder of other files
        raise StudyError("--out", f"{out} is not empty and holds no earlier export ({MANIFEST})",
                         "choose a new or empty directory") from None
    except (OSError, ValueError, AttributeError) as err:
        raise StudyError("--out", f"{out / MANIFEST} cannot be read ({err})",
                         "remove the earlier export by hand, or choose a new or empty directory") from None
    if not isinstance(listed, list) or any(not isinstance(f, str) or f in ("", ".", "..") or Path(f).name != f
                                           for f in listed):
        raise StudyError("--out", f"{out / MANIFEST} lists other paths than the export's own files",
                         "remove the earlier export by hand, or choose a new or empty directory")
    return listed


def _replace_files(new: Path, out: Path, earlier: list[str]) -> None:
    """The new export's files moved over the earlier one's, whose other listed files are removed: a user's own files
    beside them stay. The manifest moves last, so an export cut short still lists what a rerun must remove."""
    written = sorted(p.name for p in new.iterdir())
    for name in sorted(set(earlier) - set(written)):
        (out / name).unlink(missing_ok=True)
    for name in sorted(written, key=lambda n: n == MANIFEST):
        os.replace(new / name, out / name)


def _weights_dtype(choice: str, computed: str, precision: str) -> tuple[str, str]:
    if DTYPES[choice]:
        return DTYPES[choice], f"--dtype {choice}"
    if computed == "bfloat16":
        return computed, "the run computed in bf16 (its fp32 master weights rounded to bf16)"
    if computed == "float32" or precision == "fp32":
        return "float32", "the run trained in fp32"
    return "float32", (f"the checkpoint does not record what train.precision={precision} computed in; fp32 keeps "
                       "its master weights exactly (--dtype bf16 halves the files)")


def describe(exported: Exported) -> str:
    """The console summary: what was written, how to load it, and why."""
    where = f"step {exported.step} -> {exported.path} ({exported.dtype}: {exported.dtype_reason})"
    if exported.architecture:
        padded = (f"; FFN layers {sorted(exported.padded_units)} zero-padded by "
                  f"{sorted(exported.padded_units.values())} units to one width (the same function)"
                  if exported.padded_units else "")
        return (f"exported as {exported.architecture}, {where}{padded}. Load with "
                f"transformers.AutoModelForCausalLM.from_pretrained, lm-eval --model hf or vLLM")
    return (f"no transformers class computes {exported.why_study}: exported in the study format, {where}. "
            f"Load with study.export.load({str(exported.path)!r})")
