"""Batches as pure functions of (data seed, step, rank, world size, micro batch, accumulation index).

Training tokens are cut into windows of seq_len + 1 tokens at stride seq_len; epoch e visits them in the PCG64
permutation seeded with (data_seed, e), and step s takes positions [s*B, (s+1)*B) of the epochs laid end to end
(B = micro_batch * accum_steps * world_size), rank r the r-th contiguous slice and accumulation step a its a-th
micro batch. Paired runs see identical batches, ranks concatenate to the one-process batch, and a resume needs
only the step. `BatchStream` builds them ahead of the step that needs them, in one background thread; the step is
its whole state, so `BatchStream(..., start_step=s)` resumes exactly.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from study.errors import StudyError

if TYPE_CHECKING:
    import torch


def num_windows(n_tokens: int, seq_len: int) -> int:
    """Windows of seq_len + 1 tokens at stride seq_len that fit in `n_tokens`."""
    return (n_tokens - 1) // seq_len


@functools.lru_cache(maxsize=4)
def epoch_order(n: int, data_seed: int, epoch: int) -> np.ndarray:
    """The order in which epoch `epoch` visits the `n` windows."""
    order = np.random.Generator(np.random.PCG64([data_seed, epoch])).permutation(n)
    order.flags.writeable = False
    return order


def window_ids(n: int, data_seed: int, step: int, micro_batch: int, accum_steps: int = 1, accum_index: int = 0,
               rank: int = 0, world_size: int = 1) -> np.ndarray:
    """Indices of the `micro_batch` windows of one micro batch of one rank at one step."""
    if not (0 <= rank < world_size and 0 <= accum_index < accum_steps and micro_batch > 0 and step >= 0 and n > 0):
        raise ValueError(f"no micro batch {accum_index}/{accum_steps} of rank {rank}/{world_size} "
                         f"at step {step} with micro_batch {micro_batch} over {n} windows")
    global_batch = micro_batch * accum_steps * world_size
    first = step * global_batch + (rank * accum_steps + accum_index) * micro_batch
    epochs, offsets = np.divmod(first + np.arange(micro_batch), n)
    ids = np.empty(micro_batch, dtype=np.int64)
    for epoch in np.unique(epochs):
        here = epochs == epoch
        ids[here] = epoch_order(n, data_seed, int(epoch))[offsets[here]]
    return ids


def gather_windows(tokens: np.ndarray, seq_len: int, ids: np.ndarray) -> np.ndarray:
    """Rows of seq_len + 1 token ids (int64) for the given window indices."""
    starts = np.asarray(ids, dtype=np.int64) * seq_len
    return tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64)


def to_tensors(windows: np.ndarray, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets as LongTensors."""
    import torch

    rows = torch.from_numpy(windows)
    x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    return (x.pin_memory(), y.pin_memory()) if pin else (x, y)


def get_batch(tokens: np.ndarray, seq_len: int, data_seed: int, step: int, micro_batch: int, accum_steps: int = 1,
              accum_index: int = 0, rank: int = 0, world_size: int = 1,
              pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Training micro batch (x, y), each [micro_batch, seq_len]: a pure function of its arguments."""
    ids = window_ids(num_windows(len(tokens), seq_len), data_seed, step, micro_batch=micro_batch,
                     accum_steps=accum_steps, accum_index=accum_index, rank=rank, world_size=world_size)
    return to_tensors(gather_windows(tokens, seq_len, ids), pin)


def check_val_split(tokens, seq_len: int, batch_size: int, from_files: bool = False) -> int:
    """Whole validation batches the held-out tokens hold; none is refused naming the field that splits them."""
    windows = num_windows(len(tokens), seq_len)
    if windows // batch_size == 0:
        field, fix = (("data.val_tokens", "give validation files holding more tokens") if from_files else
                      ("data.val_fraction", "raise data.val_fraction (or max_docs)"))
        raise StudyError(field, f"the held-out split has {windows} windows of seq_len {seq_len}, fewer than one "
                         f"validation batch of {batch_size}", f"{fix}, or lower the validation batch size "
                         "(train.micro_batch x ranks)")
    return windows // batch_size


def val_windows(tokens: np.ndarray, seq_len: int, count: int, micro_batch: int, rank: int = 0,
                world_size: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """Rank `rank`'s contiguous share (np.array_split) of the first `count` held-out windows, `micro_batch` at a time,
    as (inputs, targets, rows that are windows of the share): summed over ranks, the one-process mean on any layout.

    Every rank yields as many batches as the largest share needs (a sharded forward is a collective): a rank whose
    share ran out scores window 0 and counts none of it."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of {world_size} ranks")
    shares = np.array_split(np.arange(min(count, num_windows(len(tokens), seq_len))), world_size)
    mine, batches = shares[rank], -(-len(shares[0]) // micro_batch)  # array_split puts the longest share first
    for b in range(batches):
        ids = mine[b * micro_batch:(b + 1) * micro_batch]
        yield (*to_tensors(gather_windows(tokens, seq_len, ids if len(ids) else np.zeros(1, np.int64))), len(ids))


def val_batches(tokens: np.ndarray, seq_len: int, batch_size: int, num_batches: int | None = None, rank: int = 0,
                world_size: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The first `num_batches` batches of consecutive held-out windows (all that fit when None), seed-independent;
    rank r gets the r-th contiguous slice of each, so the mean loss over ranks equals the one-process loss."""
    if batch_size % world_size or not 0 <= rank < world_size:
        raise ValueError(f"validation batch {batch_size} does not split into {world_size} ranks (rank {rank})")
    available = check_val_split(tokens, seq_len, batch_size)
    per_rank = batch_size // world_size
    for b in range(available if num_batches is None else min(num_batches, available)):
        first = b * batch_size + rank * per_rank
        yield to_tensors(gather_windows(tokens, seq_len, np.arange(first, first + per_rank)))


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
