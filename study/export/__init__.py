"""Export formats: our Transformer as a transformers model (`hf`), and here the study format for models no
transformers class computes (hourglass FFNs, per-layer widths). Writing a trained run out is the export job,
`study.jobs.export`.

A study-format export is a directory of `model.safetensors` (our own parameter names; a tied head stored once),
`study_export.json` (the run spec, whose `config.model` is the matched model with every per-layer width) and the
tokenizer files. Only this package is needed to read it back:

    from study.export import load
    model = load("runs/demo/0123456789ab/export")      # a study Transformer in eval mode, fp32
    logits = model(torch.tensor([[0, 17, 42]]))
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from study.errors import StudyError
from study.files import MAPPING, TEXT, damaged, read_mapping

if TYPE_CHECKING:
    from study.models.transformer import Transformer

WEIGHTS = "model.safetensors"
MANIFEST = "study_export.json"
"""What an export holds (run key, checkpoint step, format, dtype, the run spec); written in both formats."""


def load(directory: str | Path, device: str = "cpu") -> Transformer:
    """The study Transformer of an export in the study format, in eval mode. Parameters are fp32 whatever the
    file stores (bf16 weights load as their exact bf16 values)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    from safetensors.torch import load_model

    from study.config.model import ModelConfig
    from study.models.transformer import build_model

    directory = Path(directory)
    manifest = directory / MANIFEST
    if not manifest.exists():
        raise StudyError("directory", f"{directory} has no {MANIFEST}", "give a directory written by `study export`")
    fix = f"delete {directory} and export the run again (`study export RUN_KEY --format study --out {directory}`)"
    record = read_mapping(manifest, {"format": TEXT, "spec": MAPPING}, fix)
    if record["format"] != "study":
        raise StudyError("directory", f"{directory} is a {record['format']!r} export whose weights carry "
                         "transformers' names", "load it with transformers' AutoModelForCausalLM.from_pretrained")
    config = record["spec"].get("config")
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), config["model"]))
    except (OmegaConfBaseException, KeyError, TypeError, ValueError) as err:
        raise damaged(manifest, f"has no `spec.config.model` this version builds a model from ({type(err).__name__}: "
                      f"{str(err).splitlines()[0] if str(err) else ''})", fix) from None
    # random init then overwritten, as evaluation loads checkpoints; it also fills the RoPE tables (not stored)
    model = build_model(cfg, device)
    try:
        load_model(model, str(directory / WEIGHTS), strict=True, device=device)  # strict: every tensor, no other
    except Exception as err:  # noqa: BLE001 - safetensors' own error type, or an OSError: a damaged or missing file
        raise damaged(directory / WEIGHTS, f"cannot be loaded ({type(err).__name__}: {str(err)[:300]})", fix) from None
    return model.eval()
