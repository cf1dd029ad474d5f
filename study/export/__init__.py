"""Export: a trained run as files other tools read (transformers / lm-eval / vLLM, or the study format)."""

from study.export.native import load
from study.export.stage import export_run

__all__ = ["export_run", "load"]
