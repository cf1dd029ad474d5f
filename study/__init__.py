"""study: parameter-matched transformer architecture scaling studies (plan, launch, train, track, evaluate, report)."""

def installed_version() -> str:
    """The installed package's version, or `(not installed)` for a checkout that was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("study")
    except PackageNotFoundError:
        return "(not installed)"
