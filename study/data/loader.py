"""Training batches built ahead of the step that needs them, in one background thread; the step is the whole state
(every batch is `get_batch` of its step), so `BatchStream(..., start_step=s)` resumes exactly."""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from study.data.batches import get_batch

if TYPE_CHECKING:
    import torch

Step = list[tuple["torch.Tensor", "torch.Tensor"]]


class BatchStream:
    """For consecutive steps from `step`, the list of `accum_steps` micro batches (x, y) of this rank."""

    def __init__(self, tokens: np.ndarray, seq_len: int, data_seed: int, micro_batch: int, accum_steps: int = 1,
                 rank: int = 0, world_size: int = 1, start_step: int = 0, device: str | torch.device = "cpu",
                 prefetch: int = 2):
        import torch

        self.tokens, self.seq_len, self.data_seed = tokens, seq_len, data_seed
        self.micro_batch, self.accum_steps, self.rank, self.world_size = micro_batch, accum_steps, rank, world_size
        self.step = start_step
        self.device = torch.device(device)
        # Pinned host memory lets the host-to-device copy overlap the previous step's compute.
        self._pin = self.device.type == "cuda" and torch.cuda.is_available()
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(start_step,), daemon=True, name="batch-stream")
        self._thread.start()

    def build(self, step: int) -> Step:
        return [get_batch(self.tokens, self.seq_len, self.data_seed, step, self.micro_batch, self.accum_steps, a,
                          self.rank, self.world_size, pin=self._pin) for a in range(self.accum_steps)]

    def _fill(self, step: int) -> None:
        while not self._stop.is_set():
            try:
                item: Step | BaseException = self.build(step)
            except BaseException as err:  # handed to the consumer, which re-raises it with its traceback
                item = err
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
            step += 1

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> Step:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        self.step += 1
        if self.device.type == "cpu":
            return item
        return [(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)) for x, y in item]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def loader_tokens_per_s(tokens: np.ndarray, seq_len: int, micro_batch: int, accum_steps: int = 1, steps: int = 50,
                        device: str = "cpu") -> float:
    """Training tokens per second the stream delivers when the consumer does no work (its ceiling)."""
    with BatchStream(tokens, seq_len, data_seed=0, micro_batch=micro_batch, accum_steps=accum_steps,
                     device=device) as stream:
        next(stream)
        start = time.perf_counter()
        for _ in range(steps):
            next(stream)
        seconds = time.perf_counter() - start
    return steps * accum_steps * micro_batch * seq_len / seconds
