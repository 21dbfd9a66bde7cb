"""keras-hub causal LMs under ModelParallel with their own layout maps.

Tiny causal LMs built from configs (no downloaded weights) are fitted with
keras-hub's own `CausalLM.fit` on numpy arrays (a `tf.data` pipeline with
`map` and `prefetch` inside), then `generate()` greedily for a batch of
prompts: Gemma (one key/value head: uneven on a model axis of 2) on a
(1, 2) mesh, Llama (kernels sharded over both mesh axes) on a (2, 2)
("batch", "model") mesh. Every process must give what one process gives:
the losses and final weights (rtol 1e-4), the generated tokens (exactly);
and the weights must be laid out as `get_layout_map` says.

The ops those models needed are also checked without keras-hub.
"""

import functools

import numpy as np
import pytest

from tests import parity_models as pm
from tests.harness import run_on_ranks

# Gemma's uneven key/value head on the (1, 2) mesh; Llama's kernels
# sharded over both axes where the batch axis has 2 processes too.
CASES = [("gemma", (1, 2)), ("llama", (2, 2))]
# Sharding propagation of a first train step and of each generation step
# takes DTensor long on CPU: 4 processes on this 2-core machine.
TIMEOUT = 300


def _train_and_generate(rank, world_size, kind, mesh_shape):
    from tests import hub_models as hm

    return hm.train_and_generate(kind, mesh_shape)


@functools.lru_cache(maxsize=None)
def _reference(kind):
    from tests import hub_models as hm

    return pm.run_single(hm.train_and_generate, kind, None)


@pytest.mark.parametrize("kind,mesh_shape", CASES)
def test_causal_lm_fit_and_generate(kind, mesh_shape):
    results = run_on_ranks(
        _train_and_generate,
        world_size=int(np.prod(mesh_shape)),
        args=(kind, mesh_shape),
        timeout=TIMEOUT,
    )
    reference = _reference(kind)
    for rank, result in enumerate(results):
        what = f"{kind} rank {rank}"
        expected = result.pop("expected_placements")
        placements = result.pop("placements")
        assert placements == expected, what
        assert any("Shard" in p for p in placements.values()), what
        tokens = result.pop("tokens")
        np.testing.assert_array_equal(tokens, reference["tokens"], what)
        pm.assert_close(
            result,
            {k: reference[k] for k in ("history", "weights")},
            what,
        )
    pm.assert_ranks_agree(results, kind)


# --------------------------------------------------------------------------
# The ops keras-hub's models needed, without keras-hub
# --------------------------------------------------------------------------


def _ops_on_sharded_operands(rank, world_size):
    """Gemma's uneven key kernel, sampling's slice_update and while_loop."""
    import torch

    import keras
    from keras import ops
    from tests import distributions

    distribution = distributions.use_model_parallel(
        layout_rules={"key/kernel": ("model", None, None)}, mesh_shape=(1, 2)
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 5)).astype("float32")
    # One head on a model axis of 2: shards of 1 and 0 heads.
    key = keras.layers.EinsumDense(
        "btd,ndh->btnh", output_shape=(None, 1, 4), name="key"
    )
    key.build(x.shape)
    kernel = key.kernel.value
    outputs = {
        "kernel_placements": str(tuple(kernel.placements)),
        "einsum": ops.convert_to_numpy(key(x)),
        "kernel": ops.convert_to_numpy(kernel),
    }
    # A batch-sharded prompt updated at a tensor index, as samplers do.
    prompt = keras.distribution.distribute_tensor(
        np.arange(12, dtype="int32").reshape(4, 3),
        distribution.get_data_layout((4, 3)),
    )
    index = torch.tensor(1)
    update = np.full((4, 1), -1, dtype="int32")
    outputs["slice_update"] = ops.convert_to_numpy(
        ops.slice_update(prompt, [0, index], update)
    )
    # A loop body mixing the sharded loop variable with plain tensors.
    _, total = ops.while_loop(
        lambda i, v: i < 3,
        lambda i, v: (i + 1, v + ops.ones((4, 3), dtype="int32") * i),
        (0, prompt),
    )
    outputs["while_loop"] = ops.convert_to_numpy(total)
    return outputs


def test_ops_on_sharded_operands():
    per_rank = run_on_ranks(_ops_on_sharded_operands, world_size=2)
    prompt = np.arange(12, dtype="int32").reshape(4, 3)
    updated = prompt.copy()
    updated[:, 1] = -1
    for result in per_rank:
        assert "Shard(dim=0)" in result["kernel_placements"], result
        x = np.random.default_rng(0).normal(size=(2, 3, 5)).astype("float32")
        np.testing.assert_allclose(
            result["einsum"],
            np.einsum("btd,ndh->btnh", x, result["kernel"]),
            rtol=1e-5,
            atol=1e-6,
        )
        np.testing.assert_array_equal(result["slice_update"], updated)
        np.testing.assert_array_equal(result["while_loop"], prompt + 3)
    pm.assert_ranks_agree(per_rank)


def _sharded_lookup(rank, world_size):
    """An embedding sharded like keras-hub's, looked up by sharded ids."""
    import keras
    from keras import ops
    from tests import distributions

    distribution = distributions.use_model_parallel(
        layout_rules={"embedding/embeddings": ("model", "batch")},
        mesh_shape=(2, 2),
    )
    embedding = keras.layers.Embedding(16, 4, name="embedding")
    embedding.build((None, 3))
    ids = keras.distribution.distribute_tensor(
        np.arange(12, dtype="int32").reshape(4, 3),
        distribution.get_data_layout((4, 3)),
    )
    return {
        "table": ops.convert_to_numpy(embedding.embeddings),
        "lookup": ops.convert_to_numpy(embedding(ids)),
    }


def test_lookup_in_table_sharded_on_both_axes():
    per_rank = run_on_ranks(_sharded_lookup, world_size=4)
    ids = np.arange(12).reshape(4, 3)
    for result in per_rank:
        np.testing.assert_array_equal(result["lookup"], result["table"][ids])
    pm.assert_ranks_agree(per_rank)
