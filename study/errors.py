"""User-facing errors: what is wrong, which field, and how to fix it."""

from __future__ import annotations


class StudyError(Exception):
    """Bad input from the user (tracebacks are for bugs): the CLI prints it as one paragraph and exits with status 2."""

    def __init__(self, field: str, problem: str, fix: str):
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(self.message)

    @property
    def message(self) -> str:
        # one paragraph, whatever a wrapped library message brought along
        problem, fix = " ".join(str(self.problem).split()), " ".join(str(self.fix).split())
        return f"error in `{self.field}`: {problem}. Fix: {fix}"


class LaunchFailed(Exception):
    """Some runs of a local launch failed; the message lists each with its reason (the CLI exits with status 1)."""
