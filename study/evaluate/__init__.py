"""Downstream evaluation: the lm-eval adapter for study's models (`harness`), the eval stage of a trained run
(`stage`) and the shipped offline tasks (`tasks/`)."""
