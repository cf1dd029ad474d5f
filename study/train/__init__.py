"""Training one run from its spec: `loop` drives it and calls `callbacks` at every step; the other modules hold one
part each (layout, checkpoints, resume state, process set-up, ...). `python -m study.train` is the Hydra entry point."""
