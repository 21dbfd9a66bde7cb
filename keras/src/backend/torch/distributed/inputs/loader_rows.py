"""A map-style `DataLoader` under a distribution: every process draws the global
batches of indices and fetches only its rows, with the loader's workers."""

import collections
import queue
import threading
import zlib

import torch

from keras.src.backend.torch.distributed.core.collectives import all_gather_ints
from keras.src.backend.torch.distributed.inputs import data_parts


class DataLoaderRows(data_parts.SharedAdapter):
    """A map-style `DataLoader` read one process' rows at a time."""

    def __init__(self, adapter, distribution):
        super().__init__(adapter, distribution)
        loader = adapter.get_torch_dataloader()
        self._sampler = _ProcessRowsSampler(loader.batch_sampler, self._rows)
        self._loader = _loader_with_sampler(loader, self._sampler)

    def get_torch_dataloader(self):
        return data_parts.Batches(self._batches)

    def _batches(self):
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
                    _check_same_order(indices, [_length(self._sampler), digest])
                if local_size == 0:
                    rows = data_parts.take_rows(rows, 0, 0)
                data_parts.check_rows(rows, local_size)
                yield self._global_batch(rows, global_size)
                if first:
                    # Resumed: more than Keras' peek at the first batch.
                    reader.start()
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
        self._batch_sampler = batch_sampler
        self._rows = rows
        self.drawn = collections.deque()

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
            start, stop = self._rows.of(len(indices))
            drawn.append((len(indices), stop - start, indices, digest))
            yield indices[start:stop] if stop > start else indices[:1]


def _length(sampler):
    try:
        return len(sampler)
    except TypeError:
        return -1


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


def _loader_with_sampler(loader, batch_sampler):
    """A `DataLoader` like `loader`, batching with `batch_sampler` in order."""
    return torch.utils.data.DataLoader(
        loader.dataset,
        batch_sampler=batch_sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
    )


class _ReadAhead:
    """Reads an iterator ahead on a thread once `start()`ed, in line before
    (so Keras' peek at the first batch reads no more); errors raise in `next`.
    """

    def __init__(self, iterator, enabled, depth=2):
        self._iterator = iterator
        self._enabled = enabled
        self._items = queue.Queue(maxsize=depth)
        self._stopping = threading.Event()
        self._thread = None

    def __iter__(self):
        return self

    def __next__(self):
        if self._thread is None:
            return next(self._iterator)
        item = self._items.get()
        if isinstance(item, _Raised):
            raise item.error
        return item

    def start(self):
        if self._enabled and self._thread is None:
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()

    def close(self):
        """Stops reading; returns once the thread no longer reads."""
        if self._thread is not None:
            self._stopping.set()
            self._thread.join()

    def _read(self):
        try:
            for item in self._iterator:
                if not self._put(item):
                    return
            self._put(_Raised(StopIteration()))
        except BaseException as e:
            self._put(_Raised(e))

    def _put(self, item):
        # Polls only while the queue is full, to see `close()`.
        while not self._stopping.is_set():
            try:
                self._items.put(item, timeout=0.05)
            except queue.Full:
                continue
            return True
        return False


class _Raised:
    def __init__(self, error):
        self.error = error
