"""Planning, torch-free: experiment files (`experiment`), parameter accounting and matching (`budget`), per-layer
width shapes (`widths`), the planner that turns an experiment into run specs (`planner`), and the completion of a
geometry-scheduled spec from its reference's profile (`complete`)."""
