"""Data sources under a distribution: each process reads only its rows.

Without this module every process reads the whole global batch and keeps
its rows of it (`data_input.distribute_global_batch`). Sources that can be
read in parts are read in parts instead:

- A map-style `torch.utils.data.DataLoader` with a batch sampler: every
  process draws the global batches of indices from the loader's own batch
  sampler (the order one process would see) and fetches only the samples
  of its rows, with the loader's own workers and `collate_fn` (without
  workers, one thread reads ahead). Processes that share rows (along the
  other mesh axes) fetch the same samples.
- A finite `keras.utils.PyDataset`, which returns whole batches: batch `i`
  of each epoch's order is read on process `i % N`, with the dataset's own
  workers, and each batch's rows are sent to the processes that hold them.

Both yield global batches as `DTensor`s, which the step takes as they are.
Other sources (generators, iterable datasets, infinite `PyDataset`s) and
`auto_shard_dataset=False` keep the default path.
"""

import collections
import pickle
import queue
import threading
import zlib

import numpy as np
import torch
import torch.distributed as dist

from keras.src import tree
from keras.src.backend.torch.distributed import data_input
from keras.src.backend.torch.distributed import layouts
from keras.src.backend.torch.distributed import runtime
from keras.src.backend.torch.distributed.collectives import all_gather_ints
from keras.src.trainers.data_adapters import data_adapter_utils
from keras.src.trainers.data_adapters.data_adapter import DataAdapter
from keras.src.trainers.data_adapters.py_dataset_adapter import OrderedEnqueuer
from keras.src.trainers.data_adapters.py_dataset_adapter import PyDataset
from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter
from keras.src.trainers.data_adapters.torch_data_loader_adapter import (
    TorchDataLoaderAdapter,
)


def process_data_adapter(adapter):
    """Returns an adapter that reads only this process' share of the data.

    Args:
        adapter: the `DataAdapter` Keras made for the input.

    Returns:
        `adapter` itself without a multi-process distribution that shards
        the data (`auto_shard_dataset=True`), or for a source that cannot
        be read in parts; otherwise an adapter yielding global batches as
        `DTensor`s of which this process read only its share.
    """
    distribution = runtime.current_distribution()
    if (
        distribution is None
        or not distribution.auto_shard_dataset
        or runtime.world_size() == 1
    ):
        return adapter
    if isinstance(adapter, TorchDataLoaderAdapter) and _is_batched_map_loader(
        adapter.get_torch_dataloader()
    ):
        return _DataLoaderRows(adapter, distribution)
    if isinstance(adapter, PyDatasetAdapter) and adapter.num_batches:
        return _PyDatasetShares(adapter, distribution)
    return adapter


def _is_batched_map_loader(loader):
    return loader.batch_sampler is not None and not isinstance(
        loader.dataset, torch.utils.data.IterableDataset
    )


class _SharedAdapter(DataAdapter):
    """Delegates to the adapter Keras made; subclasses yield the batches."""

    def __init__(self, adapter, distribution):
        self._adapter = adapter
        self._distribution = distribution
        self._rows = _BatchRows(distribution)

    def get_numpy_iterator(self):
        return self._adapter.get_numpy_iterator()

    def get_jax_iterator(self):
        return self._adapter.get_jax_iterator()

    def get_tf_dataset(self):
        return self._adapter.get_tf_dataset()

    @property
    def num_batches(self):
        return self._adapter.num_batches

    @property
    def batch_size(self):
        return self._adapter.batch_size

    @property
    def has_partial_batch(self):
        return self._adapter.has_partial_batch

    @property
    def partial_batch_size(self):
        return self._adapter.partial_batch_size

    def on_epoch_begin(self):
        self._adapter.on_epoch_begin()

    def on_epoch_end(self):
        self._adapter.on_epoch_end()

    def _global_batch(self, rows, global_size):
        """This process' `rows` of a global batch, as `DTensor`s."""

        def put(x):
            if not data_input._is_batch_array(x):
                return x
            shape = (global_size,) + tuple(x.shape[1:])
            return data_input.distribute_data_input(
                x,
                self._distribution.get_data_layout(shape),
                self._distribution.batch_dim_name,
                global_batch_size=global_size,
            )

        return tree.map_structure(put, rows)


class _BatchRows:
    """The rows of a global batch each process holds."""

    def __init__(self, distribution):
        mesh = distribution.device_mesh.backend_mesh
        batch_dim = mesh.mesh_dim_names.index(distribution.batch_dim_name)
        self.num_parts = mesh.size(batch_dim)
        ranks = mesh.mesh
        # The batch-axis coordinate of every rank of the job.
        self.parts = {
            int(ranks[index]): index[batch_dim]
            for index in np.ndindex(*ranks.shape)
        }

    def of(self, global_size, rank=None):
        """`(start, stop)` of the rows of process `rank` (default: this)."""
        rank = runtime.rank() if rank is None else rank
        return layouts.chunk_bounds(
            global_size, self.num_parts, self.parts[rank]
        )


# ------------------------------------------------------------ DataLoader


class _DataLoaderRows(_SharedAdapter):
    """A map-style `DataLoader` read one process' rows at a time."""

    def __init__(self, adapter, distribution):
        super().__init__(adapter, distribution)
        loader = adapter.get_torch_dataloader()
        self._sampler = _ProcessRowsSampler(loader.batch_sampler, self._rows)
        self._loader = _loader_with_sampler(loader, self._sampler)

    def get_torch_dataloader(self):
        return _Batches(self._batches)

    def _batches(self):
        # Now, as `iter(loader)` would: it draws the workers' base seed.
        batches = iter(self._loader)
        # The loader's workers read ahead; without workers, one thread
        # does: a process waits for every other's rows at each step, so
        # reading in line would add up its steps' time and its reading.
        reader = _ReadAhead(batches, enabled=self._loader.num_workers == 0)
        return self._global_batches(reader, self._sampler.drawn)

    def _global_batches(self, reader, drawn):
        """Checks the order the processes drew, on this (the step's) thread.

        On the first batch (and the number of batches) and on all batches
        when the pass ends: two collectives per pass, which every process
        makes at the same point.
        """
        first, digest = True, 0
        try:
            for rows in reader:
                global_size, local_size, indices, digest = drawn.popleft()
                if first:
                    _check_same_order(indices, [_length(self._sampler), digest])
                if local_size == 0:
                    rows = _take_rows(rows, 0, 0)
                _check_rows(rows, local_size)
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
    """This process' indices of each batch of the loader's batch sampler.

    Every process draws the whole batch of indices, so samplers advance as
    in one process. A process with no rows of a batch (a last batch
    smaller than the number of batch shards) fetches its first sample and
    drops it, to know the structure of an empty part.

    Each batch drawn is recorded in `drawn` (its global and local sizes, its
    indices and a digest of the pass so far), for the checks that
    `_DataLoaderRows` makes on the step's thread.
    """

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
    """A `DataLoader` like `loader`, batching with `batch_sampler`.

    The batches come in the sampler's order (`in_order`, the default),
    which `_DataLoaderRows` relies on.
    """
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
    """Reads an iterator's items ahead on one thread once `start()`ed.

    Until then it reads in line, so that Keras' peek at the first batch
    reads no more. Items come in order; an error raised while reading is
    raised by the `next` that would have returned the item.
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


# ------------------------------------------------------------ PyDataset


class _PyDatasetShares(_SharedAdapter):
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
                    rows = tree.map_structure(_to_tensor, rows)
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
            global_size = _batch_size(batch)
            parts = []
            for rank in range(runtime.world_size()):
                start, stop = self._rows.of(global_size, rank)
                parts.append((_take_rows(batch, start, stop), global_size))
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


# ------------------------------------------------------------ batches


class _Batches:
    """An iterable whose every iteration is a fresh pass of `batches()`."""

    def __init__(self, batches):
        self._batches_fn = batches

    def __iter__(self):
        return self._batches_fn()


def _to_tensor(x):
    from keras.src.backend.torch.core import convert_to_tensor

    return None if x is None else convert_to_tensor(x)


def _take_rows(batch, start, stop):
    def take(x):
        if x is None or np.ndim(x) == 0:
            return x
        if not hasattr(x, "shape"):
            x = np.asarray(x)
        return x[start:stop]

    return tree.map_structure(take, batch)


def _batch_size(batch):
    for x in tree.flatten(batch):
        if x is not None and np.ndim(x) > 0:
            return len(x)
    raise ValueError(
        "A batch of the dataset holds no array with a batch dimension. "
        f"Received: {str(batch)[:100]}"
    )


def _check_rows(rows, local_size):
    for x in tree.flatten(rows):
        if x is not None and np.ndim(x) > 0 and len(x) != local_size:
            raise ValueError(
                "All inputs of a batch must have the same batch size. "
                f"Received sizes {local_size} and {len(x)}."
            )
