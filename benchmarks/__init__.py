"""Performance harness: one JSON line per figure, our value against a peer's measured in the same run.

    python -m benchmarks [--quick] [--only NAME ...] [--gpu]

Every row holds name, ours, peer, units, better ("higher" or "lower": which raw value is better), ratio (how many
times better ours is: > 1 means we win) and machine. See benchmarks/README.md for the figures.
"""
