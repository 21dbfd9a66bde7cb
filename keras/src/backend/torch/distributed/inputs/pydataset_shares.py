"""A finite `PyDataset` read in shares: processes take turns reading its whole
batches (with its workers, in line or through Keras' `OrderedEnqueuer`) and
scatter the rows to their holders, in one process' order."""

import collections
import inspect
import pickle
import random

import torch
import torch.distributed as dist

from keras.src import tree
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.inputs import data_input
from keras.src.backend.torch.distributed.inputs import data_parts
from keras.src.trainers.data_adapters import data_adapter_utils
from keras.src.trainers.data_adapters.py_dataset_adapter import OrderedEnqueuer
from keras.src.trainers.data_adapters.py_dataset_adapter import PyDataset


class PyDatasetShares(data_parts.SharedAdapter):
    """A finite `PyDataset`, each batch read on one process: batches, and the
    dataset state each is read in, match one process' `PyDatasetAdapter`."""

    def __init__(self, adapter, distribution):
        super().__init__(adapter, distribution)
        self._dataset, self._reader = adapter.py_dataset, None
        # Ended epochs (the shuffle seed); this object takes `on_epoch_end`.
        self._epoch = getattr(adapter, "_epoch", None)
        self._queue = adapter.enqueuer and _QueuedBatches(adapter)

    def get_torch_dataloader(self):
        # Wrapped as `PyDatasetAdapter` does, so passes draw torch's RNG alike.
        batches = self._batches if self._queue is None else self._queued_batches
        return data_adapter_utils.get_torch_dataloader(batches())

    def on_epoch_begin(self):
        if self._queue is not None:
            self._queue.start(self._epoch)
        self._dataset.on_epoch_begin()

    def on_epoch_end(self):
        if self._queue is not None:
            self._queue.stop()
        elif self._reader is not None:
            # Ended mid-pass: reread what was read ahead after `on_epoch_end`.
            self._reader.rewind()
        self._dataset.on_epoch_end()
        if self._epoch is not None:
            self._epoch += 1

    def _batches(self):
        """A pass read in line: batch `i` of the order on process `i % N`."""
        order = _pass_order(self._adapter, self._epoch)
        rank, size = runtime.rank(), runtime.world_size()
        reader = self._reader = _ShareReader(self._adapter, order[rank::size])
        try:
            for first in range(0, len(order), size):
                own = _read(reader.next) if first + rank < len(order) else None
                for src in range(min(size, len(order) - first)):
                    if src == rank and reader.stale:
                        own = _read(reader.reread)
                    yield self._shared_batch(own if src == rank else None, src)
                    reader.read_ahead()  # Resumed past Keras' first-batch peek.
        finally:
            reader.close()
            if self._reader is reader:
                self._reader = None

    def _queued_batches(self):
        """A pass through the enqueuer, as `PyDatasetAdapter` takes it."""
        self._queue.start(self._epoch)
        for _ in range(self._dataset.num_batches):
            src, batch = self._queue.next()
            yield self._shared_batch(batch, src)
        self._queue.stop()  # Only if resumed after the last batch (as Keras').

    def _shared_batch(self, batch, src):
        """The global batch `batch`, read on process `src`, as `DTensor`s."""
        rows, global_size = self._scatter_rows(batch, src)
        convert = runtime.backend_core().convert_to_tensor
        rows = tree.map_structure(convert, rows, none_is_leaf=False)
        return data_input.global_batch(rows, global_size, self._distribution)

    def _scatter_rows(self, batch, src):
        """Scatters `batch` from `src`; returns own `(rows, global_size)`. A
        read error of `src` is raised on every process."""
        parts = batch
        if batch is not None and not isinstance(batch, Exception):
            size = data_parts.batch_size(batch)
            parts = [
                (data_parts.take_rows(batch, *self._rows(size, rank)), size)
                for rank in range(runtime.world_size())
            ]
        return _scatter_objects(parts, src)


class _QueuedBatches:
    """Keras' `OrderedEnqueuer`'s batches read in shares: batch `j` of a window
    (start to stop) on process `(turn + j) % N`; `stop()` keeps what the
    enqueuer would have read ahead (queue, batch being put) for `next()`."""

    def __init__(self, adapter):
        self._adapter, queue_size = adapter, adapter.py_dataset.max_queue_size
        self._kept_at_stop = queue_size + 1 if queue_size > 0 else None
        self._kept, self._turn = collections.deque(), 0
        self._order = None  # The open window's batches.

    def start(self, epoch):
        """Opens a window unless one is open, as the enqueuer's `start`."""
        if self._order is not None:
            return
        self._order, self._taken = _pass_order(self._adapter, epoch), 0
        rank, size = runtime.rank(), runtime.world_size()
        own = self._order[(rank - self._turn) % size :: size]
        self._reader = _ShareReader(self._adapter, own)

    def stop(self):
        """Closes the window, first reading what the enqueuer read ahead (all
        if its queue is unbounded), before the dataset's `on_epoch_end`."""
        if self._order is None:
            return
        left = len(self._order) - self._taken
        count = min(left, self._kept_at_stop or left)
        self._kept.extend([self._next() for _ in range(count)])
        self._reader.close()
        self._turn, self._order = self._turn + len(self._order), None

    def next(self):
        """Returns `(src, batch)`; `batch` is None off process `src`."""
        if self._order is None:
            raise ValueError(
                "Iterator called after `on_epoch_end` or before "
                "`on_epoch_begin`."
            )
        return self._kept.popleft() if self._kept else self._next()

    def _next(self):
        if self._taken == len(self._order):
            raise ValueError(  # Keras' enqueuer would wait for a batch forever.
                "The PyDataset's enqueuer has no batch left in this epoch."
            )
        src = (self._turn + self._taken) % runtime.world_size()
        self._taken += 1
        if src != runtime.rank():
            return src, None
        batch = _read(self._reader.next)
        self._reader.read_ahead()
        return src, batch


def _pass_order(adapter, epoch):
    """A pass' batch order as Keras draws it, agreed: `random.Random(epoch)`'s
    or, where the adapter counts no epochs (`None`), process 0's `random`'s."""
    order = list(range(adapter.py_dataset.num_batches))
    if not adapter.shuffle:
        return order
    if epoch is None:
        random.shuffle(order)
        agreed = torch.tensor(order, device=runtime.comm_device())
        dist.broadcast(agreed, src=0)
        return agreed.tolist()
    random.Random(epoch).shuffle(order)
    return order


class _ShareReader:
    """Reads one process' batches of a pass (or window), in order; workers
    start on `read_ahead()`, so Keras' first-batch peek reads one."""

    def __init__(self, adapter, indices):
        self._adapter, self._dataset = adapter, adapter.py_dataset
        self._indices, self._read = indices, 0
        self._enqueuer = self._batches = None
        self.stale = False  # The last batch returned predates `rewind()`.

    def next(self):
        self._read += 1
        if self._batches is None:
            return self.reread()
        self.stale = False
        return self._adapter._standardize_batch(next(self._batches))

    def reread(self):
        """Reads the last batch `next()` returned (again), in line."""
        self.stale = False
        batch = self._dataset[self._indices[self._read - 1]]
        return self._adapter._standardize_batch(batch)

    def rewind(self):
        """Drops what was read ahead; the next batches are read anew."""
        self.close()
        self.stale = self._read > 0

    def read_ahead(self):
        rest = self._indices[self._read :]
        if self._enqueuer or not rest:
            return
        # Even for one worker: read in line, a batch would delay every process.
        self._enqueuer = OrderedEnqueuer(
            _Share(self._dataset, rest),
            workers=max(1, self._dataset.workers),
            use_multiprocessing=self._dataset.use_multiprocessing,
            max_queue_size=self._dataset.max_queue_size,
        )
        if "epoch" in inspect.signature(self._enqueuer.start).parameters:
            self._enqueuer.start(epoch=0)  # Any epoch: shares never shuffle.
        else:
            self._enqueuer.start()
        self._batches = self._enqueuer.get()

    def close(self):
        if self._enqueuer is None:
            return
        # When all is read, draining would just wait out the queue's poll;
        # otherwise join so that no read overlaps what comes next.
        done = self._read == len(self._indices)
        self._enqueuer.stop(drain_queue_and_join=not done)
        self._enqueuer = self._batches = None


class _Share(PyDataset):
    """The batches `indices` of a `PyDataset`, with its reading options."""

    def __init__(self, dataset, indices):
        super().__init__(
            workers=dataset.workers,
            use_multiprocessing=dataset.use_multiprocessing,
            max_queue_size=dataset.max_queue_size,
        )
        self._dataset, self._indices = dataset, list(indices)

    def __len__(self):
        return len(self._indices)

    def __getitem__(self, index):
        return self._dataset[self._indices[index]]


def _read(read):
    """`read()`, or the error the dataset raised, for `_scatter_objects`."""
    try:
        return read()
    except Exception as e:  # Raised on every process at its scatter.
        return e


def _scatter_objects(objects, src):
    """Gives process `i` `objects[i]` from process `src`; returns its own. An
    error as `objects` is raised on `src`, one naming `src` on the others."""
    device, failed = runtime.comm_device(), isinstance(objects, Exception)
    sizes = torch.full((runtime.world_size(),), -int(failed), device=device)
    if objects is not None and not failed:
        data = [pickle.dumps(o, pickle.HIGHEST_PROTOCOL) for o in objects]
        sizes = torch.tensor([len(d) for d in data], device=device)
    dist.broadcast(sizes, src=src)
    if failed:
        raise objects
    if int(sizes[0]) < 0:
        raise RuntimeError(
            f"Process {src} failed to read a batch of the PyDataset (its "
            "log has the error); this process stops with it."
        )
    longest = int(sizes.max())
    received = torch.empty(longest, dtype=torch.uint8, device=device)
    parts = objects and [
        torch.frombuffer(
            bytearray(d.ljust(longest, b"\0")), dtype=torch.uint8
        ).to(device)
        for d in data
    ]
    dist.scatter(received, parts, src=src)
    own = received[: int(sizes[runtime.rank()])].cpu().numpy()
    return pickle.loads(own.tobytes())
