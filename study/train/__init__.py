"""Training one run from its spec: the loop (`loop`), the resume state (`state`), checkpoints (`checkpoint`),
distributed set-up (`distributed`), optimizer and LR schedule (`optim`), stop signals (`signals`) and the fault
suite's hooks (`faults`). `python -m study.train` is the Hydra entry point (`__main__`)."""
