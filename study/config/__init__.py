"""Configuration: every config dataclass (`run`, with the eval settings, `model`, `data`, `geometry`,
`training`, `budget`, `tracking`, `cluster`, `faults`), the one composer
(`compose`), the checks (`validate`), run identity (`identity`) and the run spec a job is given (`spec`)."""

# before any config is resolved: values read through ${oc.env:...} are recorded, and written out masked
from study.config import secrets  # noqa: F401
