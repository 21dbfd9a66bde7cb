"""`AutoModelParallel` on Keras' own models, in real gloo processes.

A few cases of `tests/layer_catalogue.py` (a dense stack, attention, a
convolution, an embedding, a recurrent layer) train under
`AutoModelParallel` with no layout map on a (1, 2) mesh, all in one
process group, and must reach one process' losses and weights (pristine
Keras in a fresh interpreter). The keras-hub causal LMs run in the
catalogue's `auto_*` modes (`tests/test_keras_hub_catalogue.py`); the plan
itself is checked in one process by `tests/test_auto_plan.py`. Every case
of the layer catalogue: `KERAS_CATALOGUE_FULL=1` with the `auto` runs.
"""

import pytest

from tests import layer_catalogue as lc

CASES = ("Dense", "MultiHeadAttention", "Conv2D", "Embedding", "LSTM")
TIMEOUT = lc.CALL_TIMEOUT_BASE + lc.CALL_TIMEOUT_PER_CASE * len(CASES) + 120


@pytest.fixture(scope="module")
def reference():
    return lc.compute_reference(list(CASES))["results"]


@pytest.fixture(scope="module")
def results():
    return lc.run_mode("auto", 2, CASES, log=print)


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("name", CASES)
def test_keras_model_equals_one_process(name, reference, results):
    per_rank = results[name]
    problems = lc.compare(per_rank, reference[name])
    tracebacks = [r.get("traceback", "") for r in per_rank]
    assert not problems, "\n".join(problems) + next(
        (t for t in tracebacks if t), ""
    )
    # The plan sharded the model: some kernel is split between processes.
    placements = per_rank[0]["placements"]
    assert any("Shard" in p for p in placements.values()), placements
