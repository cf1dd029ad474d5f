"""A command's own `key=value` options (`study eval KEY tasks=a,b limit=8`)."""

from __future__ import annotations

from study.errors import StudyError


def command_options(overrides: list[str], allowed: tuple[str, ...], command: str) -> dict[str, str]:
    """The options by key: not run-config overrides, so no sweep grammar, and a key not `allowed` is refused by name."""
    values = {}
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise StudyError(item, f"is not an option of `study {command}`", f"write key=value with key one of "
                             f"{', '.join(allowed)}")
        if key not in allowed and not any(key.startswith(a + ".") for a in allowed):
            raise StudyError(key, f"is not an option of `study {command}`", f"use {', '.join(allowed)}")
        values[key] = value
    return values


def whole_option(settings: dict[str, str], name: str) -> int | None:
    """A command option that is a whole number >= 0, or None when not given."""
    if name not in settings:
        return None
    if not settings[name].isdigit():
        raise StudyError(name, f"{settings[name]!r} is not a whole number >= 0",
                         f"use {name}=N with N >= 0" + (" (0: every document)" if name == "limit" else ""))
    return int(settings[name])
