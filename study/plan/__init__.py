"""Planning, torch-free: experiment files, parameter budgets, width shapes, memory and cost estimates, tuning,
branches and racing, and the planner that turns an experiment into run specs."""
