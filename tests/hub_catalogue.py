"""The keras-hub causal LM catalogue: 24 tiny text LMs, trained everywhere.

Every text causal LM of keras-hub 0.31.1 that builds from a config is
built tiny (vocabulary 48, 1-2 layers, hidden 16, 2 heads; MoE models 4
experts, top 2) from its `Backbone` class and its `CausalLM` with
`preprocessor=None`, fitted with keras-hub's own `CausalLM.fit` on token
ids (a `tf.data` pipeline inside; 10 samples in batches of 4: the last
batch is ragged) for 2 epochs, then asked to `generate()` greedily, for
all prompts and for one alone (fewer than processes). The same model
trains under each distribution mode; one process is the reference.

Modes (`MODES`):
    "single": no distribution (one process: upstream's path).
    "dp", "dp4": `DataParallel` over 2 and 4 processes.
    "mp_last": `ModelParallel` on a (1, 2) ("batch", "model") mesh; each
        float variable's last dimension divisible by 2 is sharded over
        "model".
    "fsdp": `ModelParallel` on a (2, 1) mesh; each float variable's first
        divisible dimension over "batch".
    "2x2": `ModelParallel` on a (2, 2) mesh, 4 processes: the last
        divisible dimension over "model", the first other divisible one
        over "batch".
    "own_1x1", "own_1x2", "own_2x2": the backbone's own
        `get_layout_map(mesh)` on a (1, 1) mesh (one process: DTensors
        all the same), a (1, 2) and a (2, 2) mesh (only the models that
        have one, `OWN_LAYOUT_MODELS`).
    "auto_1x2", "auto_1x4", "auto_2x2": `AutoModelParallel` (no layout
        map) on a (1, 2), (1, 4) and (2, 2) mesh.

The generic layout maps are built from the variable paths of the model
built once without a distribution, one exact key (`re.escape(path)`) per
path. SmolLM and SmolLM3 repeat paths across their decoder layers
(`o_proj/kernel` in every block): a key then lays out several variables,
which is fine where their shapes agree (a path whose shapes disagree is
left replicated, and reported by `generic_layout_rules`).

The reference is every model trained in one fresh interpreter by pristine
Keras 3.15.1 (`compute_reference`). `run_mode` runs every model of a mode
in one process group with `tests/layer_catalogue.py`'s runner: a model
that raises fails alone, one that hangs is ended by its watchdog
(`MODEL_TIMEOUT`) and the next ones go on. `compare` says how a mode's
result differs from one process'. `python -m tests.hub_catalogue` runs
the sweep and prints the table (see `main`).
"""

import contextlib
import os
import pickle
import re
import time
import traceback

import numpy as np

SEED = 11
VOCAB = 48
SEQ_LEN = 8
NUM_SAMPLES = 10
BATCH = 4
EPOCHS = 2
# Prompts for `generate`: the first `PROMPT_LEN` tokens, the rest padding.
PROMPT_LEN = 5
# As many as the processes of the largest mode: each holds a prompt (with
# fewer prompts than processes, `generate` fails, see docs/usage.md).
NUM_PROMPTS = 4
# Tolerances of "equal to one process".
LOSS_RTOL = 1e-4
LOSS_ATOL = 1e-6
WEIGHT_RTOL = 1e-3
WEIGHT_ATOL = 1e-5

MODELS = (
    "Bloom",
    "Falcon",
    "GPT2",
    "GPTNeoX",
    "Gemma",
    "Gemma3",
    "Gemma4",
    "GptOss",
    "Llama",
    "Llama3",
    "Mistral",
    "Mixtral",
    "OPT",
    "Phi3",
    "Qwen",
    "Qwen2",
    "Qwen3",
    "Qwen3Moe",
    "Qwen3_5",
    "Qwen3_5Moe",
    "QwenMoe",
    "RWKV7",
    "SmolLM",
    "SmolLM3",
)
# Backbones with a `get_layout_map` of their own.
OWN_LAYOUT_MODELS = ("Gemma", "Llama", "Qwen", "QwenMoe", "Qwen3Moe")

# mode -> (mesh shape, or None for "dp" / "single"; layout kind).
MODES = {
    "single": (None, None),
    "dp": ((2,), "data_parallel"),
    "dp4": ((4,), "data_parallel"),
    "mp_last": ((1, 2), "last"),
    "fsdp": ((2, 1), "first"),
    "2x2": ((2, 2), "last_and_first"),
    "own_1x1": ((1, 1), "own"),
    "own_1x2": ((1, 2), "own"),
    "own_2x2": ((2, 2), "own"),
    "auto_1x2": ((1, 2), "auto"),
    "auto_1x4": ((1, 4), "auto"),
    "auto_2x2": ((2, 2), "auto"),
}
DISTRIBUTED_MODES = tuple(m for m in MODES if m != "single")


def world_size(mode):
    """The number of processes mode `mode` runs on."""
    mesh_shape = MODES[mode][0]
    return int(np.prod(mesh_shape)) if mesh_shape else 1


def models_for(mode):
    """The models mode `mode` runs."""
    return OWN_LAYOUT_MODELS if MODES[mode][1] == "own" else MODELS


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------

_COMMON = dict(
    vocabulary_size=VOCAB,
    num_layers=1,
    hidden_dim=16,
    intermediate_dim=32,
)
_HEADS = dict(num_query_heads=2, num_key_value_heads=2)
_SMOLLM = dict(
    vocabulary_size=VOCAB,
    hidden_dim=16,
    intermediate_dim=32,
    num_layers=2,
    num_attention_heads=2,
    attention_bias=False,
    attention_dropout=0.0,
    rope_layer_enabled_list=[True, False],
    layer_types=["full_attention", "full_attention"],
    mlp_bias=False,
    layer_norm_epsilon=1e-6,
    max_position_embeddings=32,
    rope_theta=10000.0,
    partial_rotary_factor=1.0,
)
_QWEN3_5 = dict(
    vocabulary_size=VOCAB,
    num_layers=2,
    num_query_heads=2,
    num_key_value_heads=2,
    head_dim=8,
    hidden_dim=16,
    # One gated delta net layer and one attention layer.
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=2,
)

# name -> backbone constructor arguments.
CONFIGS = {
    "Bloom": dict(_COMMON, num_heads=2),
    "Falcon": dict(_COMMON, num_attention_heads=2),
    "GPT2": dict(_COMMON, num_heads=2, dropout=0.0, max_sequence_length=16),
    "GPTNeoX": dict(_COMMON, num_heads=2, max_sequence_length=16),
    # One key/value head: uneven over a model axis of 2.
    "Gemma": dict(
        _COMMON, num_query_heads=2, num_key_value_heads=1, head_dim=8
    ),
    # A sliding-window layer and a global one.
    "Gemma3": dict(
        _COMMON,
        num_layers=2,
        **_HEADS,
        head_dim=8,
        image_size=16,
        sliding_window_size=4,
        use_sliding_window_attention=True,
    ),
    "Gemma4": dict(
        _COMMON,
        num_layers=2,
        **_HEADS,
        head_dim=8,
        image_size=16,
        sliding_window_size=4,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "GptOss": dict(_COMMON, **_HEADS, num_experts=4, top_k=2, head_dim=8),
    "Llama": dict(_COMMON, **_HEADS),
    "Llama3": dict(_COMMON, num_query_heads=2, num_key_value_heads=1),
    "Mistral": dict(_COMMON, num_query_heads=2, num_key_value_heads=1),
    "Mixtral": dict(_COMMON, **_HEADS, num_experts=4, top_k=2),
    "OPT": dict(_COMMON, num_heads=2, dropout=0.0, max_sequence_length=16),
    "Phi3": dict(_COMMON, **_HEADS),
    "Qwen": dict(_COMMON, **_HEADS),
    "Qwen2": dict(_COMMON, **_HEADS, tie_word_embeddings=False),
    "Qwen3": dict(_COMMON, **_HEADS, head_dim=8),
    "Qwen3Moe": dict(
        _COMMON,
        **_HEADS,
        head_dim=8,
        moe_intermediate_dim=16,
        num_experts=4,
        top_k=2,
    ),
    "Qwen3_5": dict(_QWEN3_5, intermediate_dim=32),
    "Qwen3_5Moe": dict(
        _QWEN3_5,
        moe_intermediate_dim=16,
        shared_expert_intermediate_size=16,
        num_experts=4,
        top_k=2,
    ),
    "QwenMoe": dict(
        _COMMON,
        **_HEADS,
        moe_intermediate_dim=16,
        shared_expert_intermediate_dim=16,
        num_experts=4,
        top_k=2,
    ),
    "RWKV7": dict(
        vocabulary_size=VOCAB,
        num_layers=1,
        hidden_size=16,
        head_size=8,
        intermediate_dim=32,
        gate_lora=8,
        mv_lora=8,
        aaa_lora=8,
        decay_lora=8,
    ),
    "SmolLM": dict(_SMOLLM, num_key_value_heads=1),
    "SmolLM3": dict(_SMOLLM, num_key_value_heads=2),
}
# Variants of catalogue models for tests of one mechanism, not in
# `MODELS`: name -> the model whose classes build it. Grouped-query
# attention whose key/value heads no model axis of 2 or 4 divides, beside
# query heads it does, and a vocabulary that makes the embedding a preset's
# share of the model: `AutoModelParallel` replicates their key/value heads
# (Megatron-LM's, within `auto_plan.REPLICATION_BUDGET`), where the tiny
# models' heads are too large a part of them. Llama attends with
# `dot_product_attention`, Gemma with einsums, Qwen3 normalizes its keys.
VARIANT_OF = {
    "LlamaGrouped": "Llama",
    "GemmaGrouped": "Gemma",
    "Qwen3Grouped": "Qwen3",
}
_GROUPED = dict(num_query_heads=4, vocabulary_size=1024)
CONFIGS["LlamaGrouped"] = dict(
    CONFIGS["Llama"], **_GROUPED, num_key_value_heads=2
)
CONFIGS["GemmaGrouped"] = dict(CONFIGS["Gemma"], **_GROUPED)
CONFIGS["Qwen3Grouped"] = dict(
    CONFIGS["Qwen3"], **_GROUPED, num_key_value_heads=1
)
# Models whose backbone takes the token positions as an input.
NEEDS_POSITION_IDS = ("Gemma4",)


def backbone_class(name):
    import keras_hub

    return getattr(keras_hub.models, VARIANT_OF.get(name, name) + "Backbone")


def build_causal_lm(name):
    """The tiny `<name>CausalLM`, seeded, without preprocessor, compiled."""
    import keras_hub

    import keras

    keras.utils.set_random_seed(SEED)
    backbone = backbone_class(name)(**CONFIGS[name])
    model = VARIANT_OF.get(name, name)
    lm = getattr(keras_hub.models, model + "CausalLM")(
        backbone=backbone, preprocessor=None
    )
    # Adam keeps sharded optimizer state to compare. Its larger epsilon
    # keeps weights whose gradient is ~0 (an attention key bias: softmax
    # ignores it) from turning float noise into updates of the learning
    # rate's size, as in `tests/parity_models.py`: Adam divides a gradient
    # by its own magnitude, so a gradient that is zero but for rounding
    # becomes a step whose sign depends on the summation order.
    lm.compile(
        optimizer=keras.optimizers.Adam(learning_rate=0.01, epsilon=1e-3),
        sampler="greedy",
    )
    return lm


def make_data(name, num_samples=NUM_SAMPLES, seed=0):
    """`(x, y, sample_weight)` numpy arrays: next-token prediction."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, size=(num_samples, SEQ_LEN + 1))
    lengths = rng.integers(SEQ_LEN // 2, SEQ_LEN + 1, size=num_samples)
    mask = np.arange(SEQ_LEN)[None, :] < lengths[:, None]
    x = {
        "token_ids": np.where(mask, tokens[:, :-1], 0).astype("int32"),
        "padding_mask": mask,
    }
    if name in NEEDS_POSITION_IDS:
        x["position_ids"] = np.broadcast_to(
            np.arange(SEQ_LEN, dtype="int32"), (num_samples, SEQ_LEN)
        ).copy()
    y = np.where(mask, tokens[:, 1:], 0).astype("int32")
    return x, y, mask.astype("float32")


def prompts(name):
    """`generate()` inputs: `NUM_PROMPTS` prompts of `PROMPT_LEN` tokens.

    Padded to `SEQ_LEN`: generation fills the rest. RWKV7 takes its
    preprocessor's format instead (the prompt but its last token as the
    prefill, left-padded; the last token starts `predict_token_ids`).
    Gemma3 gets an empty `images` input: its `generate` returns the input's
    `images`, and `None` there cannot be concatenated.
    """
    rng = np.random.default_rng(3)
    tokens = rng.integers(1, VOCAB, size=(NUM_PROMPTS, PROMPT_LEN))
    tokens = tokens.astype("int32")
    if name == "RWKV7":
        prefill = np.zeros((NUM_PROMPTS, SEQ_LEN), "int32")
        prefill[:, SEQ_LEN - PROMPT_LEN + 1 :] = tokens[:, :-1]
        predict = np.zeros((NUM_PROMPTS, SEQ_LEN - PROMPT_LEN + 1), "int32")
        predict[:, 0] = tokens[:, -1]
        return {
            "token_ids": prefill,
            "input_padding_mask": prefill != 0,
            "padding_mask": predict != 0,
            "predict_token_ids": predict,
        }
    token_ids = np.zeros((NUM_PROMPTS, SEQ_LEN), "int32")
    token_ids[:, :PROMPT_LEN] = tokens
    inputs = {"token_ids": token_ids, "padding_mask": token_ids != 0}
    if name == "Gemma3":
        size = CONFIGS[name]["image_size"]
        inputs["images"] = np.zeros((NUM_PROMPTS, 0, size, size, 3), "float32")
    return inputs


# --------------------------------------------------------------------------
# Layout maps
# --------------------------------------------------------------------------


def variable_specs(name):
    """`[(path, shape, dtype)]` of the model's variables, no distribution."""
    import keras

    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    try:
        lm = build_causal_lm(name)
        return [(v.path, tuple(v.shape), v.dtype) for v in lm.weights]
    finally:
        keras.backend.clear_session()


def generic_layout_rules(specs, kind, axis_size=2):
    """Layout rules `{re.escape(path): axes}` of layout kind `kind`.

    Args:
        specs: `variable_specs(...)`.
        kind: "last" (the last dimension divisible by `axis_size` over
            "model"), "first" (the first one over "batch") or
            "last_and_first" (the last over "model", the first other one
            over "batch").
        axis_size: the size of the mesh axes.

    Returns:
        `(rules, conflicts)`: the rules, and the paths left out because
        variables of different shapes share them.
    """
    shapes = {}
    for path, shape, dtype in specs:
        if "float" in str(dtype):
            shapes.setdefault(path, set()).add(shape)
    rules = {}
    conflicts = []
    for path, path_shapes in shapes.items():
        if len(path_shapes) > 1:
            conflicts.append(path)
            continue
        (shape,) = path_shapes
        divisible = [
            i for i, size in enumerate(shape) if size and size % axis_size == 0
        ]
        if not divisible:
            continue
        axes = [None] * len(shape)
        if kind in ("last", "last_and_first"):
            axes[divisible[-1]] = "model"
        if kind == "first":
            axes[divisible[0]] = "batch"
        if kind == "last_and_first" and len(divisible) > 1:
            axes[divisible[0]] = "batch"
        rules[re.escape(path)] = tuple(axes)
    return rules, conflicts


def use_mode(name, mode):
    """Sets the distribution of `mode` for model `name`.

    Returns:
        The generic layout rules (`{}` for the other modes).
    """
    from keras import distribution as kd
    from tests import distributions

    mesh_shape, kind = MODES[mode]
    if kind == "data_parallel":
        distributions.use_data_parallel()
        return {}
    if kind == "own":
        mesh = distributions.device_mesh(mesh_shape)
        layout_map = backbone_class(name).get_layout_map(mesh)
        kd.set_distribution(
            kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
        )
        return {}
    if kind == "auto":
        mesh = distributions.device_mesh(mesh_shape)
        kd.set_distribution(kd.AutoModelParallel(device_mesh=mesh))
        return {}
    rules, _ = generic_layout_rules(variable_specs(name), kind)
    distributions.use_model_parallel(layout_rules=rules, mesh_shape=mesh_shape)
    return rules


# --------------------------------------------------------------------------
# One model, one mode
# --------------------------------------------------------------------------


def _fallback_counts():
    """`{op: (calls, bytes, reason)}` so far (the project's `fallback`)."""
    from keras.src.backend.torch.distributed.dtensor_gaps import fallback

    return {
        op: (count.calls, count.gathered_bytes, count.reason)
        for op, count in fallback.fallback_counts().items()
    }


def _first_step_recorder():
    """A callback keeping `_fallback_counts()` after the first train step."""
    import keras

    class FirstStep(keras.callbacks.Callback):
        counts = None

        def on_train_batch_end(self, batch, logs=None):
            if self.counts is None:
                self.counts = _fallback_counts()

    return FirstStep()


def train_and_generate(name, mode):
    """Fits model `name` under `mode` with keras-hub's `fit`, generates.

    In mode "single" nothing of the project is imported: the reference
    runs this with pristine Keras.

    Returns:
        A dict: the epoch `losses`; the final `weights` (`get_weights()`,
        global values), their `paths` and `placements` (`{path: text}`);
        the layout `rules` of a generic mode; the generated `tokens`, and
        `tokens_one_prompt` of the first prompt alone; the `fallbacks`
        (`{op: (calls, bytes, reason)}`) of the first train step and of
        the whole `fit` (distributed modes);
        `layer_classes` (none: `layer_catalogue.compare` skips it); the
        `path` of the train step (see `train_path`).
    """
    import keras

    keras.distribution.set_distribution(None)
    rules = {} if mode == "single" else use_mode(name, mode)
    lm = build_causal_lm(name)
    x, y, sample_weight = make_data(name)
    callbacks = []
    counter = None
    if mode != "single":
        from keras.src.backend.torch.distributed.dtensor_gaps import fallback

        fallback.reset_fallback_counts()
        callbacks.append(_first_step_recorder())
        counter = _layer_catalogue().gather_counter()
        callbacks.append(counter.callback())
    with counter or contextlib.nullcontext():
        history = lm.fit(
            x,
            y,
            sample_weight=sample_weight,
            batch_size=BATCH,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
    fallbacks = None
    if callbacks:
        fallbacks = {"first_step": callbacks[0].counts}
        fallbacks["fit"] = _fallback_counts()
    generated = lm.generate(
        prompts(name), max_length=SEQ_LEN, stop_token_ids=None
    )
    # One prompt: fewer than processes, a batch that cannot be split.
    one_prompt = {key: value[:1] for key, value in prompts(name).items()}
    generated_one = lm.generate(
        one_prompt, max_length=SEQ_LEN, stop_token_ids=None
    )
    expected = None
    if mode != "single" and MODES[mode][1] == "own":
        distribution = keras.distribution.distribution()
        expected = expected_placements(lm, distribution._layout_map)
    return {
        "losses": [float(v) for v in history.history["loss"]],
        "weights": [np.array(w) for w in lm.get_weights()],
        "paths": [v.path for v in lm.weights],
        "placements": {
            v.path: str(tuple(getattr(v.value, "placements", ())))
            for v in lm.weights
        },
        "expected_placements": expected,
        "rules": rules,
        "tokens": np.asarray(generated["token_ids"]),
        "tokens_one_prompt": np.asarray(generated_one["token_ids"]),
        "fallbacks": fallbacks,
        "parameter_bytes": parameter_bytes(lm),
        "path": "" if mode == "single" else train_path(lm),
        # Bytes all-gathered in each train step (a list, one per step).
        "gathered_bytes": [] if counter is None else counter.per_step,
    }


def train_path(model):
    """`"local"` if the train step called `model` on each process' rows,
    `"dtensor: <why>"` if through DTensor, `""` without a probe."""
    from tests import distributions

    verdict = distributions.call_verdict(model, "train", training=True)
    if verdict is None:
        return ""
    if not verdict.per_sample:
        return f"dtensor: {verdict.reason}"
    if verdict.coupled:
        # On the local rows, the layers that couple samples on DTensor.
        return f"local but coupled layers: {verdict.reason}"
    return "local"


def expected_placements(model, layout_map):
    """`{path: placements as text}` that `layout_map` asks for (a variable
    no rule matches is replicated)."""
    mesh_axes = layout_map.device_mesh.axis_names
    expected = {}
    for variable in model.weights:
        layout = layout_map[variable.path]
        axes = tuple(layout.axes) if layout is not None else ()
        placements = [
            f"Shard(dim={axes.index(name)})" if name in axes else "Replicate()"
            for name in mesh_axes
        ]
        expected[variable.path] = "(" + ", ".join(placements) + ")"
    return expected


def parameter_bytes(model):
    """`(bytes this process stores, bytes of the whole model)` of `model`'s
    weights (local metadata only: no collective)."""
    local = total = 0
    for variable in model.weights:
        value = variable.value
        shard = value.to_local() if hasattr(value, "to_local") else value
        local += shard.numel() * shard.element_size()
        total += value.numel() * value.element_size()
    return local, total


def _layer_catalogue():
    """`tests/layer_catalogue.py`: its runner, reference and comparison.

    The pristine reference interpreter loads both files by path, as
    `layer_catalogue`; the project's tests import it from `tests`.
    """
    import sys

    module = sys.modules.get("layer_catalogue")
    if module is not None:
        return module
    from tests import layer_catalogue

    return layer_catalogue


def run_guarded(name, mode):
    """`train_and_generate`, an exception recorded as the model's result.

    Returns:
        `train_and_generate`'s dict, or `{"error": kind, "traceback":
        ...}` (see `layer_catalogue.error_kind`); either way with the
        model's "seconds". The distribution is cleared and the session
        reset after the model.
    """
    import keras

    start = time.monotonic()
    try:
        result = train_and_generate(name, mode)
    except Exception as error:
        frames = traceback.format_exception(error)
        result = {
            "error": _layer_catalogue().error_kind(error),
            "traceback": "".join(frames[-8:])[-4000:],
        }
    finally:
        keras.distribution.set_distribution(None)
        keras.backend.clear_session()
    result["seconds"] = time.monotonic() - start
    return result


def write_reference(path, names=None, num_samples=None):
    """The models `names` (default all) in one process, pickled to `path`.

    See `layer_catalogue.write_reference` (`num_samples` is ignored: the
    data is `make_data`'s).
    """
    _layer_catalogue().write_reference(
        path,
        list(MODELS if names is None else names),
        run_one=lambda name: run_guarded(name, "single"),
    )


def compute_reference(names=None):
    """The models `names` trained by pristine Keras 3.15.1, one process.

    Returns:
        `layer_catalogue.compute_reference`'s dict.
    """
    return _layer_catalogue().compute_reference(
        list(MODELS if names is None else names),
        module_file=os.path.abspath(__file__),
        timeout=REFERENCE_TIMEOUT,
    )


# --------------------------------------------------------------------------
# A mode's run: its models in one process group
# --------------------------------------------------------------------------

# Bounds (seconds). A collective waits at most `COLLECTIVE_TIMEOUT`; a
# model's watchdog ends its processes after `MODEL_TIMEOUT` (a model takes
# 5-60 s; 4 processes on 2 loaded cores up to ~3x that; the workers
# inherit `KERAS_HUB_MODEL_TIMEOUT`, which overrides it); the call, which
# the watchdog should always beat, gets a model's bound per model.
COLLECTIVE_TIMEOUT = 60
MODEL_TIMEOUT = int(os.environ.get("KERAS_HUB_MODEL_TIMEOUT", "300"))
CALL_OVERHEAD = 600
REFERENCE_TIMEOUT = 900


def mode_body(rank, world_size, mode, names, out_dir, num_samples):
    """The harness body: `run_guarded` of `names` under `mode`, in turn.

    See `layer_catalogue.run_cases` (`num_samples` is ignored).
    """
    import keras_hub  # noqa: F401 - imported once, outside the timings.

    def run_one(name):
        result = run_guarded(name, mode)
        status = result.get("error", "ok")
        # Progress in the worker's log (forwarded after the call).
        print(
            f"hub_catalogue: {mode} {name} {result['seconds']:.1f} s {status}",
            flush=True,
        )
        return result

    return _layer_catalogue().run_cases(
        rank,
        names,
        out_dir,
        run_one,
        collective_timeout=COLLECTIVE_TIMEOUT,
        case_timeout=MODEL_TIMEOUT,
    )


def run_mode(mode, models=None, log=None):
    """Runs `models` (default `models_for(mode)`) under `mode`.

    All in one `run_on_ranks` call on `world_size(mode)` gloo processes,
    one after the other; a model that raises fails alone, one that hangs
    is ended by its watchdog and the others go on in a fresh process
    group (`layer_catalogue.run_mode`).

    Returns:
        `{model: [result per rank]}` (see `run_guarded`).
    """
    models = list(models_for(mode) if models is None else models)
    return _layer_catalogue().run_mode(
        mode,
        world_size(mode),
        models,
        log=log,
        body=mode_body,
        call_timeout=CALL_OVERHEAD + MODEL_TIMEOUT * len(models),
    )


# --------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------


def compare(per_rank, reference):
    """How one model's per-rank results differ from one process' result.

    `layer_catalogue.compare` (losses rtol `LOSS_RTOL`, weights
    `WEIGHT_RTOL`, every rank against the reference and rank 0, each
    variable with a generic layout rule sharded), plus: the generated
    tokens are one process' exactly on every rank, and some variable is
    sharded in a model-parallel mode.

    Returns:
        A list of problems (text), empty when equal.
    """
    problems = _layer_catalogue().compare(per_rank, reference)
    if problems:
        return problems
    for rank, result in enumerate(per_rank):
        for key in ("tokens", "tokens_one_prompt"):
            if not np.array_equal(result[key], reference[key]):
                problems.append(
                    f"rank {rank}: generated {key} differ: "
                    f"{result[key].tolist()} != {reference[key].tolist()}"
                )
    return problems


def check_sharded(mode, per_rank):
    """A problem (text) if no variable of a model-parallel mode is sharded,
    or, under the backbone's own layout map, if a variable is not laid out
    as the map says."""
    if MODES[mode][1] in (None, "data_parallel"):
        return None
    for result in per_rank:
        placements = result.get("placements", {})
        expected = result.get("expected_placements")
        if expected is not None and placements != expected:
            wrong = sorted(
                p for p in expected if placements.get(p) != expected[p]
            )
            return f"{mode}: not laid out as its layout map says: {wrong[:5]}"
    placements = per_rank[0].get("placements", {})
    if any("Shard" in p for p in placements.values()):
        return None
    return f"{mode}: no variable is sharded"


def failure_kind(mode, per_rank, reference):
    """The kind of a model's failure (`layer_catalogue.failure_kind`, or a
    token or sharding problem), or None when it equals one process."""
    lc = _layer_catalogue()
    kind = lc.failure_kind(per_rank, reference)
    if kind is not None:
        return kind
    problems = compare(per_rank, reference)
    if problems:
        return "generated tokens differ"
    return check_sharded(mode, per_rank)


# --------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------


def run_sweep(modes=DISTRIBUTED_MODES, models=None, log=print):
    """The reference and `modes`, each in one process group.

    Returns:
        `(reference, results, seconds)`: `{model: result}` of pristine
        Keras in one process; `{mode: {model: [result per rank]}}`; the
        seconds of each mode (the reference's under "single").
    """
    start = time.monotonic()
    reference = compute_reference(models)["results"]
    seconds = {"single": time.monotonic() - start}
    log(f"reference (pristine Keras, one process): {seconds['single']:.0f} s")
    results = {}
    for mode in modes:
        names = [m for m in models_for(mode) if models is None or m in models]
        start = time.monotonic()
        results[mode] = run_mode(mode, names, log=log)
        seconds[mode] = time.monotonic() - start
        failing = sum(
            failure_kind(mode, results[mode][n], reference[n]) is not None
            for n in names
        )
        log(
            f"{mode}: {len(names) - failing}/{len(names)} equal one process "
            f"({seconds[mode]:.0f} s)"
        )
    return reference, results, seconds


def table(reference, results, seconds):
    """The sweep as Markdown lines: a row per mode, failures by kind."""
    broken = {n: r["error"] for n, r in reference.items() if "error" in r}
    lines = [
        "| mode | processes | equal to one process | seconds | failures |",
        "| --- | --- | --- | --- | --- |",
        f"| single (pristine Keras) | 1 | {len(reference) - len(broken)}/"
        f"{len(reference)} | {seconds['single']:.0f} | "
        + "; ".join(f"{n}: {e}" for n, e in broken.items())
        + " |",
    ]
    for mode, by_model in results.items():
        groups = {}
        for name, per_rank in by_model.items():
            kind = failure_kind(mode, per_rank, reference[name])
            if kind is not None:
                groups.setdefault(kind, []).append(name)
        failing = sum(len(names) for names in groups.values())
        text = "; ".join(
            f"{kind[:150]}: {', '.join(names)}"
            for kind, names in groups.items()
        )
        lines.append(
            f"| {mode} | {world_size(mode)} | {len(by_model) - failing}/"
            f"{len(by_model)} | {seconds[mode]:.0f} | {text} |"
        )
    return lines


def bytes_lines(results):
    """Per model-parallel mode, the largest share of the model's parameter
    bytes one process stores, and the models above 1/N of it plus 5%."""
    lines = []
    for mode, by_model in results.items():
        if MODES[mode][1] in (None, "data_parallel"):
            continue
        shares = {}
        for name, per_rank in by_model.items():
            stored = [
                r["parameter_bytes"] for r in per_rank if "error" not in r
            ]
            if stored:
                shares[name] = max(local / total for local, total in stored)
        if not shares:
            continue
        bound = 1 / world_size(mode) + 0.05
        over = sorted(n for n, share in shares.items() if share > bound)
        largest = max(shares, key=shares.get)
        lines.append(
            f"{mode}: largest share of the parameter bytes on one process "
            f"{shares[largest]:.3f} ({largest}); bound 1/N + 0.05 = "
            f"{bound:.3f}; over it: {', '.join(over) or 'none'}"
        )
    return lines


def fallback_lines(results, mode="own_2x2", name="Llama"):
    """The ops model `name` computed on global values in its first step."""
    per_rank = results.get(mode, {}).get(name)
    if per_rank is None:
        return [f"{name} {mode}: not run"]
    result = per_rank[0]
    if "error" in result:
        return [f"{name} {mode}: {result['error']}"]
    lines = []
    for stage in ("first_step", "fit"):
        rows = result["fallbacks"][stage] or {}
        lines += [
            f"{name} {mode}, {stage} (rank 0): ops computed on global values",
            "| op | calls | bytes gathered | DTensor's reason |",
            "| --- | --- | --- | --- |",
        ]
        for op, (calls, nbytes, reason) in sorted(rows.items()):
            lines.append(f"| {op} | {calls} | {nbytes} | {reason[:120]} |")
        if not rows:
            lines.append("| (none) | | | |")
    return lines


def detail_lines(reference, results):
    """Per failure: its problems and the innermost traceback."""
    lines = []
    for mode, by_model in results.items():
        for name, per_rank in by_model.items():
            kind = failure_kind(mode, per_rank, reference[name])
            if kind is None:
                continue
            lines.append(f"===== {mode} {name}: {kind}")
            lines += compare(per_rank, reference[name])[:8]
            tracebacks = [r.get("traceback", "") for r in per_rank]
            lines.append(next((t for t in tracebacks if t), "")[-2500:])
    return lines


def main(argv=None):
    """Runs the sweep and prints the table.

    Usage (from the repository root, with the project's venv):

        KERAS_BACKEND=torch .venv/bin/python -m tests.hub_catalogue \
            [--modes dp,fsdp] [--models Llama,Gemma] [--details] \
            [--save results.pkl]
    """
    import argparse

    import torch

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--modes", default=",".join(DISTRIBUTED_MODES))
    parser.add_argument("--models", default=None)
    parser.add_argument(
        "--details", action="store_true", help="tracebacks and differences"
    )
    parser.add_argument(
        "--save", help="pickle (reference, results, seconds) to this file"
    )
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    models = args.models.split(",") if args.models else None
    unknown = set(modes) - set(DISTRIBUTED_MODES)
    unknown |= set(models or ()) - set(MODELS)
    if unknown:
        parser.error(f"unknown modes or models: {sorted(unknown)}")
    print(f"torch {torch.__version__}", flush=True)

    def log(text):
        print(text, flush=True)

    reference, results, seconds = run_sweep(modes, models, log=log)
    if args.save:
        with open(args.save, "wb") as file:
            pickle.dump((reference, results, seconds), file)
    print("\n".join(table(reference, results, seconds)))
    print()
    print("\n".join(fallback_lines(results)))
    print("\n".join(bytes_lines(results)))
    if args.details:
        print("\n".join(detail_lines(reference, results)))


if __name__ == "__main__":
    # Through the module's importable name: the workers import the body
    # (`mode_body`) by module name, and `__main__` is not one.
    from tests import hub_catalogue

    hub_catalogue.main()
