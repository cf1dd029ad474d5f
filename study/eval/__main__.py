"""`python -m study.eval ARGS`: lm-eval's own command line with the `study` model registered (lm-eval 0.4.13 and
older ignore the `lm_eval.models` entry point in pyproject.toml, so `lm_eval --model study` alone is unknown there):

    python -m study.eval --model study --model_args run=KEY,tracking_uri=sqlite:///path/mlflow.db \\
        --tasks arc_easy_local --limit 20

The shipped offline tasks' folder is lm-eval's `--include_path` unless the command names one. It scores only
(lm-eval prints or writes the results); `study eval` records them with the run.
"""

from __future__ import annotations

import sys

from study.errors import StudyError


def main() -> int:
    import study.eval.harness  # noqa: F401  (registers `--model study`)
    from lm_eval.__main__ import cli_evaluate

    from study.config.tasks import LOCAL_TASK_DIR

    # the shipped offline tasks (`*_local`) as `--include_path` where none is given: the folder is inside the
    # installed package, which a user outside the checkout cannot name by a relative path
    if not any(a == "--include_path" or a.startswith("--include_path=") for a in sys.argv[1:]):
        sys.argv += ["--include_path", str(LOCAL_TASK_DIR)]
    try:
        cli_evaluate()  # reads sys.argv, as `lm_eval` does
    except StudyError as error:
        print(f"python -m study.eval: {error.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
