"""A map-style `DataLoader` under a distribution: every process draws the global
batches of indices and fetches only its rows, with the loader's workers."""

import collections
import concurrent.futures
import zlib

import torch

from keras.src.backend.torch.distributed.core.collectives import all_gather_ints
from keras.src.backend.torch.distributed.inputs import data_input
from keras.src.backend.torch.distributed.inputs import data_parts

_LOADER_OPTIONS = (
    "num_workers collate_fn pin_memory timeout worker_init_fn generator "
    "multiprocessing_context prefetch_factor persistent_workers "
    "pin_memory_device"
).split()


class DataLoaderRows(data_parts.SharedAdapter):
    """A map-style `DataLoader` read one process' rows at a time."""

    def __init__(self, adapter, distribution):
        super().__init__(adapter, distribution)
        loader = adapter.get_torch_dataloader()
        self._sampler = _ProcessRowsSampler(loader.batch_sampler, self._rows)
        # Like `loader`, batching with the sampler, in order.
        options = {name: getattr(loader, name) for name in _LOADER_OPTIONS}
        self._loader = torch.utils.data.DataLoader(
            loader.dataset, batch_sampler=self._sampler, **options
        )

    def get_torch_dataloader(self):
        return self  # Iterable: every iteration is a fresh pass.

    def __iter__(self):
        # Created here, as `iter(loader)` would: it draws the workers' seed.
        batches = iter(self._loader)
        # No workers: read ahead on a thread, as each step waits for all rows.
        reader = _ReadAhead(batches, enabled=self._loader.num_workers == 0)
        return self._global_batches(reader, self._sampler.drawn)

    def _global_batches(self, reader, drawn):
        """Checks on the step's thread that every process drew one order."""
        first, digest = True, 0
        try:
            for rows in reader:
                global_size, local_size, indices, digest = drawn.popleft()
                if first:
                    try:
                        length = len(self._sampler)
                    except TypeError:
                        length = -1
                    _check_same_order(indices, [length, digest])
                if local_size == 0:
                    rows = data_parts.take_rows(rows, 0, 0)
                data_parts.check_rows(rows, local_size)
                yield data_input.global_batch(
                    rows, global_size, self._distribution
                )
                if first:
                    reader.start()  # Resumed past Keras' first-batch peek.
                    first = False
        finally:
            reader.close()
        # Two ints, as the first check: every gather has the same size.
        _check_same_order("the whole epoch", [-1, digest])


class _ProcessRowsSampler(torch.utils.data.Sampler):
    """This process' indices of each batch the batch sampler draws (whole, so
    samplers advance as in one process); with no rows in a batch, the first
    sample is fetched for an empty part's structure."""

    def __init__(self, batch_sampler, rows):
        self._batch_sampler, self._rows = batch_sampler, rows

    def __len__(self):
        return len(self._batch_sampler)

    def __iter__(self):
        self.drawn = collections.deque()
        return self._indices(self.drawn)

    def _indices(self, drawn):
        digest = 0
        for indices in self._batch_sampler:
            indices = list(indices)
            digest = zlib.crc32(repr(indices).encode(), digest)
            start, stop = self._rows(len(indices))
            drawn.append((len(indices), stop - start, indices, digest))
            yield indices[start:stop] if stop > start else indices[:1]


def _check_same_order(drawn, digest):
    """Raises unless every process drew the same batches."""
    digests = all_gather_ints(digest, None)
    if any(other != digest for other in digests):
        raise ValueError(
            "The DataLoader's sampler gives the processes different batches "
            f"(this process drew {str(drawn)[:80]}). Under a distribution "
            "every process follows the sampler's order and fetches its rows "
            "of each batch, so the sampler must draw the same order on every "
            "process: give the DataLoader a seeded generator "
            "(`generator=torch.Generator().manual_seed(seed)`), or set the "
            "same seed on every process with `keras.utils.set_random_seed`."
        )


class _ReadAhead:
    """Reads an iterator up to 3 items ahead on a thread once `start()`ed, in
    line before (so Keras' peek at the first batch reads no more)."""

    def __init__(self, iterator, enabled):
        self._iterator, self._enabled, self._pool = iterator, enabled, None
        self._ahead = collections.deque()

    def __iter__(self):
        return self

    def __next__(self):
        if self._pool is None:
            return next(self._iterator)
        self._ahead.append(self._pool.submit(next, self._iterator))
        return self._ahead.popleft().result()

    def start(self):
        if self._enabled and self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1)
            for _ in range(3):
                self._ahead.append(self._pool.submit(next, self._iterator))

    def close(self):
        """Stops reading; returns once the thread no longer reads."""
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
