"""Export formats: our Transformer as a transformers model (`hf`) and the study format for models no transformers
class computes (`native`). Writing a trained run out is the export job, `study.jobs.export`."""

from study.export.native import load

__all__ = ["load"]
