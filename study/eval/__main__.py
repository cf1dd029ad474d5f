"""`python -m study.eval ARGS`: lm-eval's own command line with the `study` model registered.

The package registers `study` under lm-eval's `lm_eval.models` entry-point group (pyproject.toml), which lm-eval
releases that read plugins use for `lm_eval --model study`. lm-eval 0.4.13 and older find models only in their own
table or among classes already registered in the process, so there `lm_eval --model study` alone answers
"Unknown model 'study'". This imports the registration, then hands the same arguments to lm-eval's CLI:

    python -m study.eval --model study --model_args run=KEY,tracking_uri=sqlite:///path/mlflow.db \\
        --tasks arc_easy_local --include_path study/eval/tasks --limit 20

It scores only: lm-eval prints (and with --output_path writes) the results, nothing is added to the run's records.
`study eval` is the recording path.
"""

from __future__ import annotations

import sys

from study.errors import StudyError


def main() -> int:
    import study.eval.harness  # noqa: F401  (registers `--model study`)
    from lm_eval.__main__ import cli_evaluate

    try:
        cli_evaluate()  # reads sys.argv, as `lm_eval` does
    except StudyError as error:
        print(f"python -m study.eval: {error.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
