"""Tracking in MLflow: the buffered tracker, config as params and the other ranks' null tracker (`tracker`), store
access and retries (`store`), run tags and lineage (`lineage`), parent runs (`groups`) and the one query module for
reading back (`query`)."""
