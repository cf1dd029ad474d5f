"""Tracking in MLflow: the buffered tracker (`tracker`), store access and retries (`store`), config as params
(`params`), run tags (`tags`) and the one query module for reading back (`query`)."""
