"""Whether lm-eval's hub tasks can get their data here, asked before a run's model is loaded: where the Hugging Face
Hub cannot be reached (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, or no answer to one request), a hub task whose dataset
is in neither local cache is refused by name, not after lm-eval indexed its catalogue and retried the download. A
task whose dataset its YAML does not name (a group, a Python task) is left to lm-eval (study.eval.harness)."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from study.config.tasks import LOCAL_TASK_DIR, local_task_names, task_yaml
from study.errors import StudyError

HUB_PROBE_TIMEOUT_S = 3.0
"""How long the Hub's endpoint may take to answer one request, without retries, before it counts as unreachable."""

_TRUE = {"1", "on", "yes", "true"}


def check_hub_data(names: Sequence[str], field: str = "tasks", task_dir: Path = LOCAL_TASK_DIR) -> None:
    """Refuses the hub tasks among `names` whose data cannot be had here: the Hub is unreachable and their dataset
    is in neither local cache. Local tasks, and any task while the Hub answers, pass without a look."""
    local = local_task_names(task_dir)
    hub = [name for name in names if name not in local]
    why = hub_unreachable() if hub else None
    if why is None:
        return
    missing = {name: d for name in hub if (d := hub_dataset(name)) is not None and not is_cached(d[0])}
    if missing:
        wanted = "; ".join(f"{name}: {path}" + (f" ({config})" if config else "")
                           for name, (path, config) in missing.items())
        loads = "; ".join(f"datasets.load_dataset({path!r}" + (f", {config!r})" if config else ")")
                          for path, config in dict.fromkeys(missing.values()))
        # the shipped offline task of each hub task that has one (`arc_easy` -> `arc_easy_local`), else the first
        twins = [f"{name}_local" for name in missing if f"{name}_local" in local] or [local[0]]
        raise StudyError(field, f"hub task(s) {list(missing)} need data from the Hugging Face Hub, which {why}, and "
                         f"the local Hugging Face cache does not hold it ({wanted})",
                         f"use the shipped offline tasks {local} (here tasks={','.join(twins)}), "
                         f"or download the data once where the Hub answers (`python -c \"import datasets; {loads}\"` "
                         "keeps it in the cache under HF_HOME) and evaluate with HF_HUB_OFFLINE=1")


def hub_unreachable() -> str | None:
    """Why the Hub cannot be reached from here, in words ending a sentence about it; None when it answers."""
    for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(flag, "").strip().lower() in _TRUE:
            return f"this process is told not to reach ({flag}={os.environ[flag]})"
    endpoint = os.environ.get("HF_ENDPOINT", "").rstrip("/") or "https://huggingface.co"
    return _probe(endpoint)


@functools.lru_cache(maxsize=4)
def _probe(endpoint: str) -> str | None:
    """One HEAD request to the endpoint, once per process: any HTTP answer, an error status too, means reachable."""
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=HUB_PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        return f"does not answer at {endpoint} ({reason})"
    return None


def hub_dataset(name: str) -> tuple[str, str | None] | None:
    """(dataset_path, dataset_name) of lm-eval's task `name` from its YAML and those it includes (None where none
    names it): reads the few files that mention the name, not lm-eval's whole index (about 10 s)."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    declares = re.compile(rf"^task:\s*['\"]?{re.escape(name)}['\"]?\s*$", re.MULTILINE)
    for path in sorted(Path(spec.submodule_search_locations[0], "tasks").rglob("*.yaml")):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        if name in text and declares.search(text):
            config = _with_includes(path)
            if config.get("dataset_path"):
                return str(config["dataset_path"]), config.get("dataset_name")
    return None


def _with_includes(path: Path, depth: int = 0) -> dict:
    """A task YAML over the YAML it `include:`s (relative to its folder), as lm-eval merges them."""
    try:
        config = task_yaml(path)
    except Exception:  # noqa: BLE001  (a YAML lm-eval itself may read differently: no dataset known from it)
        return {}
    if not isinstance(config, dict):
        return {}
    base = config.get("include")
    if isinstance(base, str) and depth < 4:
        return {**_with_includes(path.parent / base, depth + 1), **config}
    return config


def is_cached(dataset_path: str) -> bool:
    """The dataset is in the hub cache or datasets' own cache, as the environment names them now."""
    home = Path(os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache",
                                                   "huggingface")).expanduser()
    hub = Path(os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or home / "hub")
    data = Path(os.environ.get("HF_DATASETS_CACHE") or home / "datasets")
    return ((hub.expanduser() / f"datasets--{dataset_path.replace('/', '--')}").is_dir()
            or (data.expanduser() / dataset_path.replace("/", "___")).is_dir())
