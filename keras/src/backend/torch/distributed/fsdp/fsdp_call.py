"""A layer call's weights, gathered in one collective, their storage freed
after the call and refilled when backward reaches it (autograd's saved
tensors keep the metadata only)."""

import threading

import torch

from keras.src.backend.torch.distributed.fsdp import fsdp_gather

_thread_state = threading.local()  # Per thread, as Keras' own state is.


def calls_now():
    """The calls whose gathered weights are in use, innermost last."""
    return vars(_thread_state).setdefault("calls", [])


class CallGather:
    """A layer call's `GatheredWeight`s, gathered and freed together."""

    def __init__(self, weights):
        self.weights, self.released = weights, []
        # Prefetches for the call (`gather_ahead`) and, with the weights they
        # restore, its backward ops; a function prefetching the previous call's.
        self.ahead = self.ahead_key = self.restoring = None
        self.restore_ahead_of = None

    def _gather(self, weights, async_op=False):
        # In the compute dtype: `to` returns the shard itself if it is.
        shards = [w.sharded.to(w.dtype) for w in weights]
        placements = [w.placements for w in weights]
        return fsdp_gather.gather(shards, placements, async_op=async_op)

    def _key(self):
        """What a gather ahead must match to stand for this call's."""
        return (
            [(id(w.variable), w.placements, w.dtype) for w in self.weights],
            [w.sharded._version for w in self.weights],
            torch.is_grad_enabled(),
        )

    def gather_ahead(self):
        """Starts gathering the values, for a call to come."""
        self.ahead = self._gather(self.weights, async_op=True)
        self.ahead_key = self._key()

    def take(self, other):
        """Takes `other`'s prefetch if it matches this call, else drops it."""
        if other is None:
            return
        if other.ahead is not None and other.ahead_key == self._key():
            self.ahead, other.ahead = other.ahead, None
        else:
            other.drop_ahead()

    def drop_ahead(self):
        """Waits for the gathers started ahead and forgets them."""
        for pending in (self.ahead, self.restoring and self.restoring[0]):
            if pending is not None:
                pending.wait()
        self.ahead = self.restoring = None

    def enter(self):
        """Gathers the values and lets them stand for the variables."""
        pending = self.ahead or self._gather(self.weights)
        self.ahead, self._storages = None, {}
        for w, value in zip(self.weights, pending.values()):
            w.saved, w.value, w.version = False, value, value._version
            w.variable._value = value
            with torch.no_grad():
                local = fsdp_gather.local_tensor(value)
            self._storages[local.untyped_storage().data_ptr()] = w

    def note_saved(self, pointer):
        """Marks the weight whose storage is at `pointer` as autograd-saved."""
        if pointer in self._storages:
            self._storages[pointer].saved = True

    def exit(self):
        """Gives the variables their sharded values back."""
        for weight in self.weights:
            weight.variable._value = weight.sharded

    def release(self, outputs, reshard):
        """Writes back assignments; if `reshard`, frees storage: whether any."""
        for weight in self.weights:
            weight.write_back()
        if not reshard:
            return False
        self.released = [w for w in self.weights if w.release(outputs)]
        return bool(self.released)

    def _freed(self):
        return [w for w in self.released if w.needs_restore()]

    def restore_ahead(self):
        """Starts regathering the freed values for their backward ops, unless
        none or started already; returns whether it did."""
        weights = self._freed()
        if self.restoring is not None or not weights:
            return False
        with torch.no_grad():
            self.restoring = self._gather(weights, async_op=True), weights
        return True

    def on_gradient(self, grad):
        """Output gradient hook: regathers, then prefetches the prior call."""
        if self.restore() and self.restore_ahead_of is not None:
            self.restore_ahead_of()
        return grad

    def restore(self):
        """Regathers freed values autograd still holds; returns whether any."""
        freed, fresh = self._freed(), {}
        if self.restoring is not None:
            pending, weights = self.restoring
            fresh = dict(zip(map(id, weights), pending.local_values()))
            self.restoring = None
        missing = [w for w in freed if id(w) not in fresh]
        if missing:
            with torch.no_grad():
                gathered = self._gather(missing).local_values()
            fresh.update(zip(map(id, missing), gathered))
        for weight in freed:
            weight.fill(fresh[id(weight)])
        return bool(freed)


class GatheredWeight:
    """A trainable variable's value gathered to `placements`, for one call."""

    def __init__(self, variable, placements):
        self.variable = variable
        self.sharded = variable._value
        self.placements = placements
        # Compute dtype under mixed precision: shards are cast, then gathered.
        self.dtype = getattr(torch, variable.dtype)
        self.storage, self.saved = None, False

    def write_back(self):
        """Copies what the call assigned (`SpectralNormalization`) to shards,
        unless a compute-dtype copy (Keras' assignment to it has no effect)."""
        sharded = self.sharded
        if self.value._version != self.version and self.dtype == sharded.dtype:
            with torch.no_grad():
                sharded.copy_(
                    self.value.redistribute(
                        sharded.device_mesh, sharded.placements
                    )
                )
        self.version = self.value._version

    def release(self, outputs):
        """Frees the gathered storage after forward, unless without gradients
        or shared with `outputs` or the shard; returns whether it did."""
        value = self.value
        if not (value.requires_grad and torch.is_grad_enabled()):
            return False
        with torch.no_grad():
            # Not `to_local`: with gradients it returns a new view each time.
            local = fsdp_gather.local_tensor(value)
            shared = [self.sharded.to_local()] + [
                fsdp_gather.local_tensor(x) for x in outputs
            ]
        storage = local.untyped_storage()
        pointer = storage.data_ptr()
        if any(x.untyped_storage().data_ptr() == pointer for x in shared):
            return False
        self.storage, self.nbytes = storage, storage.nbytes()
        storage.resize_(0)
        # Once the gradient is complete, every backward op reading it has run.
        value.register_hook(self._release_after_backward)
        self.value = None
        self.geometry = local.storage_offset(), local.shape, local.stride()
        return True

    def needs_restore(self):
        """Whether the backward pass has yet to gather the value again."""
        return self.saved and self.storage.nbytes() != self.nbytes

    def fill(self, fresh):
        """Writes the gathered local tensor `fresh` into the freed storage."""
        with torch.no_grad():
            self.storage.resize_(self.nbytes)
            # Not through the local tensor: that bumps the version counter its
            # views share, and autograd would refuse the views it saved.
            target = fresh.new_empty(0).set_(self.storage, *self.geometry)
            target.copy_(fresh)

    def _release_after_backward(self, grad):
        self.storage.resize_(0)
        return grad
