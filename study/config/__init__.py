"""Configuration: every config dataclass (`run`, `sections`, `model`, `data`, `geometry`), the one composer
(`compose`), the checks (`validate`), run identity (`identity`) and the run spec a job is given (`spec`)."""
