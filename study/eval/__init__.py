"""Downstream evaluation: the lm-eval adapter for study's models (`harness`), finding a trained run
from what a user names (`locate`), the evaluation records of a run (`records`) and the shipped offline tasks
(`tasks/`). Evaluating a run and filing its scores is the evaluate job, `study.jobs.eval`."""
