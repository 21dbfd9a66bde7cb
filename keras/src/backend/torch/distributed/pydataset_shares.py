"""A finite `PyDataset` under a distribution, read in shares.

A `PyDataset` returns whole batches: batch `i` of each epoch's order is
read on process `i % N`, with the dataset's own workers (one thread at
least), and each batch's rows are sent to the processes that hold them.
"""

import pickle

import torch
import torch.distributed as dist

from keras.src import tree
from keras.src.backend.torch.distributed import data_parts
from keras.src.backend.torch.distributed import runtime
from keras.src.trainers.data_adapters import data_adapter_utils
from keras.src.trainers.data_adapters.py_dataset_adapter import OrderedEnqueuer
from keras.src.trainers.data_adapters.py_dataset_adapter import PyDataset


class PyDatasetShares(data_parts.SharedAdapter):
    """A finite `PyDataset` read in shares: batch `i` on process `i % N`.

    Each epoch follows process 0's order of the batches (shuffled or not,
    as in one process). The processes read in rounds of N batches, each
    its own one (with the dataset's workers, or one thread, reading ahead),
    then every batch of the round is scattered from its
    reader to the processes that hold its rows.
    """

    def __init__(self, adapter, distribution):
        super().__init__(adapter, distribution)
        self._dataset = adapter.py_dataset
        self._reader = None

    def get_torch_dataloader(self):
        # Wrapped as `PyDatasetAdapter` wraps its batches (the `DTensor`s
        # are kept as they are), so that each pass draws torch's random
        # state as in one process.
        return data_adapter_utils.get_torch_dataloader(self._batches())

    def on_epoch_begin(self):
        self._dataset.on_epoch_begin()

    def on_epoch_end(self):
        if self._reader is not None:
            # An epoch of `steps_per_epoch` ended within a pass, which the
            # next epoch goes on with: what was read ahead is read again
            # after `on_epoch_end`, as one process reads it.
            self._reader.rewind()
        self._dataset.on_epoch_end()

    def _batches(self):
        order = _process_zero_order(self._epoch_order())
        rank, size = runtime.rank(), runtime.world_size()
        reader = self._reader = _ShareReader(self._adapter, order[rank::size])
        try:
            for first in range(0, len(order), size):
                own = reader.next() if first + rank < len(order) else None
                for src in range(min(size, len(order) - first)):
                    if src == rank and reader.stale:
                        own = reader.reread()
                    batch = own if src == rank else None
                    rows, global_size = self._scatter_rows(batch, src)
                    # Tensors as `PyDatasetAdapter` gives them to torch.
                    rows = tree.map_structure(data_parts.to_tensor, rows)
                    yield self._global_batch(rows, global_size)
                    # Resumed: more than Keras' peek at the first batch.
                    reader.read_ahead()
        finally:
            reader.close()
            if self._reader is reader:
                self._reader = None

    def _epoch_order(self):
        order = list(range(self._dataset.num_batches))
        if self._adapter.shuffle:
            # As `PyDatasetAdapter` shuffles, from the same random state.
            import random

            random.shuffle(order)
        return order

    def _scatter_rows(self, batch, src):
        """Sends each process its rows of `batch`, read on process `src`.

        Returns:
            `(rows, global_size)`: this process' rows of the batch.
        """
        parts = None
        if batch is not None:
            global_size = data_parts.batch_size(batch)
            parts = []
            for rank in range(runtime.world_size()):
                start, stop = self._rows.of(global_size, rank)
                parts.append(
                    (data_parts.take_rows(batch, start, stop), global_size)
                )
        return _scatter_objects(parts, src)


class _ShareReader:
    """Reads one process' batches of a `PyDataset` pass, in order.

    The first batch is read at once; the dataset's workers (at least one
    thread) start reading the others ahead only on `read_ahead()`, so that
    Keras' peek at the first batch reads no more.
    """

    def __init__(self, adapter, indices):
        self._adapter = adapter
        self._dataset = adapter.py_dataset
        self._indices = indices
        self._read = 0
        self._enqueuer = None
        self._batches = None
        # The last batch `next()` returned was read before `rewind()`.
        self.stale = False

    def next(self):
        index = self._indices[self._read]
        self._read += 1
        self.stale = False
        if self._batches is not None:
            batch = next(self._batches)
        else:
            batch = self._dataset[index]
        return self._adapter._standardize_batch(batch)

    def reread(self):
        """Reads the last batch `next()` returned again, in line."""
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
        # Even a dataset of one worker, which one process reads between
        # steps, is read here while the steps run: a process waits for
        # every other's batch, so reading in line would add up its steps'
        # time and its reading.
        self._enqueuer = OrderedEnqueuer(
            _Share(self._dataset, rest),
            workers=max(1, self._dataset.workers),
            use_multiprocessing=self._dataset.use_multiprocessing,
            max_queue_size=self._dataset.max_queue_size,
        )
        self._enqueuer.start()
        self._batches = self._enqueuer.get()

    def close(self):
        if self._enqueuer is None:
            return
        # With every batch read there is nothing to wait for: draining
        # the queue would wait out its 0.1 s poll at each epoch's end.
        # Otherwise it is joined: no read overlaps what comes next.
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
        self._dataset = dataset
        self._indices = list(indices)

    def __len__(self):
        return len(self._indices)

    def __getitem__(self, index):
        return self._dataset[self._indices[index]]


def _process_zero_order(order):
    """Process 0's `order` of the batches, on every process."""
    agreed = torch.tensor(
        order, dtype=torch.int64, device=runtime.comm_device()
    )
    dist.broadcast(agreed, src=0)
    return agreed.tolist()


def _scatter_objects(objects, src):
    """Gives process `i` `objects[i]` from process `src`; returns its own.

    Two collectives: the pickled sizes, then the padded bytes.
    """
    device = runtime.comm_device()
    size = runtime.world_size()
    sizes = torch.zeros(size, dtype=torch.int64, device=device)
    if objects is not None:
        data = [
            pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL) for o in objects
        ]
        sizes = torch.tensor([len(d) for d in data], device=device)
    dist.broadcast(sizes, src=src)
    longest = int(sizes.max())
    received = torch.empty(longest, dtype=torch.uint8, device=device)
    parts = None
    if objects is not None:
        parts = [_padded_bytes(d, longest, device) for d in data]
    dist.scatter(received, parts, src=src)
    own = received[: int(sizes[runtime.rank()])].cpu().numpy()
    return pickle.loads(own.tobytes())


def _padded_bytes(data, length, device):
    padded = torch.zeros(length, dtype=torch.uint8)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return padded.to(device)
