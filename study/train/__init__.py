"""Training one run from its spec: the loop (`loop`) and the callbacks it calls at every step (`callbacks`), how the
model is laid out on the devices (`parallelize`), the run directory around training (`run_directory`), the resume
state (`state`), checkpoints (`checkpoint`), process set-up (`distributed`), optimizer and LR schedule (`optim`),
stop signals (`signals`), progress (`progress`) and the fault suite's hooks (`faults`). `python -m study.train` is the
Hydra entry point (`__main__`)."""
