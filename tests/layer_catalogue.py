"""The `keras.layers` catalogue: one tiny training case per layer class.

Every class that `keras.layers` exports is either covered by a case here
(`CASES`: a case's name is the class name, or the class name, "-" and a
variant, see `case_layer`), an alias of a covered class (`ALIASES`), or
listed in `NOT_CASES` with the reason it cannot train in a torch model;
`tests/test_layer_catalogue.py` checks that this enumeration is complete,
so a layer added upstream fails the test until it is placed.

A case is a small functional model, usually
`Input -> Dense -> LAYER -> Flatten -> Dense`, trained by `run_case` for
`EPOCHS` epochs on `NUM_SAMPLES` fixed samples in batches of `BATCH_SIZE`
(the last batch is ragged: 7 rows, split 4/3 on 2 batch shards and
2/2/2/1 on 4), with a fixed Keras seed. `run_case(name, mode)` returns the
per-epoch losses and the final weights; the modes are:

    "single": no distribution (the reference: run with pristine Keras).
    "dp": `DataParallel` over every process.
    "mp_last": `ModelParallel` on a (1, N) ("batch", "model") mesh; every
        float variable of rank >= 1 has its last dimension divisible by 2
        sharded over "model".
    "mp_first": the same with the first divisible dimension.
    "fsdp": a (N, 1) mesh; the first divisible dimension of every float
        variable sharded over "batch" (weights FSDP-style, data over the
        batch axis too).
    "2x2": a (2, 2) mesh of 4 processes; the last divisible dimension
        sharded over "model", the first other divisible one over "batch".
    "auto", "auto_2x2": `AutoModelParallel` (its own plan, no layout map)
        on a (1, N) and a (2, 2) mesh.

The model-parallel layouts are derived from the variables themselves: the
case is built once with no distribution to learn each variable's path and
shape, and the `LayoutMap` gets one exact-path key (`re.escape`) per
sharded variable.

`run_mode` (parent side) runs all the cases of a mode on real gloo
processes (`tests/harness.py`), one case after the other in one process
group, each case's failure recorded as that case's result: an exception;
a collective that waits more than `COLLECTIVE_TIMEOUT`; processes left out
of step by a case that failed on some of them only (the run goes on in a
fresh process group); a call that times out (the case that was running
fails with the stacks of the processes, and the run goes on after it).
`compute_reference` runs the "single" mode of every case in one fresh
interpreter on pristine upstream Keras. `compare` says how a case's result
differs from the reference.

This module imports keras only inside functions and nothing of the project
at module level, so the pristine interpreter can load it by path.
"""

import dataclasses
import os
import re
import traceback

import numpy as np

SEED = 1234
NUM_SAMPLES = 23
BATCH_SIZE = 8
EPOCHS = 2
NUM_OUTPUTS = 3
VOCAB_SIZE = 12
LEARNING_RATE = 0.05

MODES = (
    "single",
    "dp",
    "mp_last",
    "mp_first",
    "fsdp",
    "2x2",
    "auto",
    "auto_2x2",
)
# The distributed runs of the sweep: name -> (mode, number of processes).
RUNS = {
    "dp2": ("dp", 2),
    "dp4": ("dp", 4),
    "mp_last": ("mp_last", 2),
    "mp_first": ("mp_first", 2),
    "fsdp": ("fsdp", 2),
    "2x2": ("2x2", 4),
    "auto": ("auto", 2),
    "auto4": ("auto", 4),
    "auto_2x2": ("auto_2x2", 4),
}
# Comparison with the reference (float32 over 6 steps).
LOSS_RTOL, LOSS_ATOL = 1e-4, 1e-6
WEIGHT_RTOL, WEIGHT_ATOL = 1e-3, 1e-5


# Wall-clock bounds of a mode's run (seconds): collectives first (a stuck
# collective fails its case), then the call, by the number of its cases.
COLLECTIVE_TIMEOUT = 60
# The agreement between cases waits longer than any collective, so that a
# rank stuck in one reaches it after its own collective timed out.
AGREEMENT_TIMEOUT = 3 * COLLECTIVE_TIMEOUT
CALL_TIMEOUT_BASE = 2 * AGREEMENT_TIMEOUT
CALL_TIMEOUT_PER_CASE = 30
# A case's watchdog (`run_cases`): a case takes 1-10 s.
CASE_TIMEOUT = 120


@dataclasses.dataclass(frozen=True)
class Case:
    """One catalogue case.

    Attributes:
        build: `build(layers, input_shape)` returns the uncompiled model
            (`layers` is `keras.layers`); called after the seed is set.
        input_shape: the model's input shape, without the batch dimension.
        input_dtype: "float32" (uniform in [-1, 1]) or "int32" (token ids
            in `[0, VOCAB_SIZE)`).
        loss: "mse" (3 regression targets) or "sparse_ce" (3 classes,
            from logits).
        zero_tail: zeroes the last two time steps of every other sample
            (what `Masking` masks).
    """

    build: object
    input_shape: tuple
    input_dtype: str = "float32"
    loss: str = "mse"
    zero_tail: bool = False


def case_layer(name):
    """The `keras.layers` class a case covers: its name up to a "-".

    A class may have several cases, e.g. "GRU" and
    "GRU-reset_after_false".
    """
    return name.split("-")[0]


# --------------------------------------------------------------------------
# Model builders
# --------------------------------------------------------------------------


def _model(inputs, outputs):
    import keras

    return keras.Model(inputs, outputs)


def _head(layers, x):
    """`Flatten -> Dense(NUM_OUTPUTS)`: every case ends with it."""
    x = layers.Flatten(name="flatten")(x)
    return layers.Dense(NUM_OUTPUTS, name="dense_out")(x)


def _sandwich(
    factory, input_shape, *, units=4, images=False, call="one", **options
):
    """A case `Input -> Dense(units) -> LAYER -> Flatten -> Dense(3)`.

    Args:
        factory: `factory(layers)` returns the layer.
        input_shape: the input shape; the Dense works on its last axis.
        units: the Dense's width (the layer's features or channels).
        images: map the Dense's output into about [0, 1] (the value
            range the image layers are given) with a `Rescaling`.
        call: how the layer takes its input: "one" tensor, the same
            always with `training=True` ("train", see `_training_call`),
            a "list" of two branches (merging layers) or a "pair" of two
            arguments (`MultiHeadAttention(query, value)`).
        **options: the other `Case` fields.
    """

    def build(layers, shape):
        inputs = layers.Input(shape)
        x = layers.Dense(units, name="dense_in")(inputs)
        if images:
            x = layers.Rescaling(0.25, offset=0.5, name="to_unit_range")(x)
        layer = factory(layers)
        if call == "one":
            x = layer(x)
        elif call == "train":
            x = _training_call(layer)(x)
        else:
            other = layers.Dense(units, name="dense_other")(inputs)
            x = layer([x, other]) if call == "list" else layer(x, other)
        return _model(inputs, _head(layers, x))

    return Case(build, input_shape, **options)


def _image(factory, call="one"):
    """A sandwich on 6x6 RGB images with values in about [0, 1].

    An affine map, not a sigmoid: some image layers modify their input in
    place, which autograd refuses for a sigmoid's output (its backward
    needs it).
    """
    return _sandwich(factory, (6, 6, 3), units=3, images=True, call=call)


def _tokens(factory, *, ids=None):
    """A case `Input(int32) -> LAYER -> [Embedding] -> Flatten -> Dense(3)`.

    Args:
        factory: `factory(layers)` returns the layer.
        ids: the number of ids the layer outputs, if it outputs ids: they
            go through an `Embedding` of that many rows first.
    """

    def build(layers, shape):
        inputs = layers.Input(shape, dtype="int32")
        x = factory(layers)(inputs)
        if ids is not None:
            x = layers.Embedding(ids, 4, name="embedding")(x)
        return _model(inputs, _head(layers, x))

    return Case(build, (6,), input_dtype="int32", loss="sparse_ce")


def _reversible_embedding(layers, shape):
    inputs = layers.Input(shape, dtype="int32")
    embedding = layers.ReversibleEmbedding(VOCAB_SIZE, 4, name="layer")
    # The tied reverse projection too: the table's transpose, to logits.
    x = embedding(embedding(inputs), reverse=True)
    return _model(inputs, _head(layers, x))


def _masking(layers, shape):
    inputs = layers.Input(shape)
    x = layers.Masking(0.0, name="layer")(inputs)
    x = layers.LSTM(4, name="lstm")(x)
    return _model(inputs, layers.Dense(NUM_OUTPUTS, name="dense_out")(x))


def _discretization(layers, shape):
    inputs = layers.Input(shape)
    x = layers.Dense(4, name="dense_in")(inputs)
    # Bucket ids in [0, 4), into an Embedding: no gradient flows back.
    x = layers.Discretization(bin_boundaries=[-0.5, 0.0, 0.5], name="layer")(x)
    x = layers.Embedding(4, 4, name="embedding")(x)
    return _model(inputs, _head(layers, x))


_TRAINING_CALL = []


def _training_call(layer):
    """`layer` in a layer that always calls it with `training=True`.

    For image layers that return their very input when built in a
    functional model (a cycle in the graph) or another shape at inference
    than in training: the wrapper's output is a new tensor, with the
    training shape.
    """
    if not _TRAINING_CALL:
        import keras

        class TrainingCall(keras.layers.Layer):
            def __init__(self, inner, **kwargs):
                super().__init__(**kwargs)
                self.inner = inner

            def call(self, x):
                return self.inner(x, training=True)

        _TRAINING_CALL.append(TrainingCall)
    return _TRAINING_CALL[0](layer)


def _torch_linear(layers):
    import torch

    return layers.TorchModuleWrapper(
        torch.nn.Linear(4, 6), output_shape=(None, 5, 6)
    )


def _affine(x):
    return 2.0 * x + 1.0


# --------------------------------------------------------------------------
# The catalogue
# --------------------------------------------------------------------------

_SEQ = (5, 4)  # (time, features)
_IMG = (6, 6, 3)  # (height, width, channels): channels_last
_RANGE = (0, 1)  # The images' value range.
_SEED = 7  # Of the random layers given a seed of their own.


def _cases():
    s = _sandwich
    image = _image
    cases = {
        # -- core ------------------------------------------------------
        "Dense": s(lambda L: L.Dense(6), (5,)),
        "Dense-activity_regularizer": s(
            lambda L: L.Dense(6, activity_regularizer="l2"), (5,)
        ),
        "EinsumDense": s(
            lambda L: L.EinsumDense(
                "abc,cd->abd", output_shape=(5, 6), bias_axes="d"
            ),
            _SEQ,
        ),
        "Embedding": _tokens(lambda L: L.Embedding(VOCAB_SIZE, 4)),
        "ReversibleEmbedding": Case(
            _reversible_embedding, (6,), input_dtype="int32", loss="sparse_ce"
        ),
        "Identity": s(lambda L: L.Identity(), _SEQ),
        "Lambda": s(lambda L: L.Lambda(_affine), _SEQ),
        "Masking": Case(_masking, _SEQ, zero_tail=True),
        "TorchModuleWrapper": s(_torch_linear, _SEQ),
        # -- activations -----------------------------------------------
        "Activation": s(lambda L: L.Activation("tanh"), (5,), units=6),
        "ELU": s(lambda L: L.ELU(), (5,), units=6),
        "LeakyReLU": s(lambda L: L.LeakyReLU(0.2), (5,), units=6),
        "PReLU": s(lambda L: L.PReLU(), (5,), units=6),
        "ReLU": s(lambda L: L.ReLU(max_value=1.0), (5,), units=6),
        "Softmax": s(lambda L: L.Softmax(), (5,), units=6),
        # -- convolution -----------------------------------------------
        "Conv1D": s(lambda L: L.Conv1D(4, 3), (6, 3)),
        "Conv1D-groups": s(lambda L: L.Conv1D(4, 3, groups=2), (6, 3)),
        "Conv2D": s(lambda L: L.Conv2D(4, 3), _IMG),
        "Conv2D-groups": s(lambda L: L.Conv2D(4, 3, groups=2), _IMG),
        "Conv3D": s(lambda L: L.Conv3D(4, 3), (4, 4, 4, 2)),
        "Conv1DTranspose": s(
            lambda L: L.Conv1DTranspose(4, 3, strides=2), (4, 3)
        ),
        "Conv2DTranspose": s(
            lambda L: L.Conv2DTranspose(4, 3, strides=2), (4, 4, 2)
        ),
        "Conv3DTranspose": s(
            lambda L: L.Conv3DTranspose(2, 2, strides=2), (2, 2, 2, 2)
        ),
        "DepthwiseConv1D": s(
            lambda L: L.DepthwiseConv1D(3, depth_multiplier=2), (6, 3)
        ),
        "DepthwiseConv2D": s(
            lambda L: L.DepthwiseConv2D(3, depth_multiplier=2), _IMG
        ),
        "SeparableConv1D": s(
            lambda L: L.SeparableConv1D(4, 3, depth_multiplier=2), (6, 3)
        ),
        "SeparableConv2D": s(lambda L: L.SeparableConv2D(4, 3), _IMG),
        # -- pooling ---------------------------------------------------
        "MaxPooling1D": s(lambda L: L.MaxPooling1D(2), (8, 3)),
        "AveragePooling1D": s(lambda L: L.AveragePooling1D(2), (8, 3)),
        "MaxPooling2D": s(lambda L: L.MaxPooling2D(2), (4, 4, 3)),
        "AveragePooling2D": s(lambda L: L.AveragePooling2D(2), (4, 4, 3)),
        "MaxPooling3D": s(lambda L: L.MaxPooling3D(2), (4, 4, 4, 2)),
        "AveragePooling3D": s(lambda L: L.AveragePooling3D(2), (4, 4, 4, 2)),
        "GlobalMaxPooling1D": s(lambda L: L.GlobalMaxPooling1D(), _SEQ),
        "GlobalAveragePooling1D": s(lambda L: L.GlobalAveragePooling1D(), _SEQ),
        "GlobalMaxPooling2D": s(lambda L: L.GlobalMaxPooling2D(), (4, 4, 3)),
        "GlobalAveragePooling2D": s(
            lambda L: L.GlobalAveragePooling2D(), (4, 4, 3)
        ),
        "GlobalMaxPooling3D": s(lambda L: L.GlobalMaxPooling3D(), (2, 2, 2, 2)),
        "GlobalAveragePooling3D": s(
            lambda L: L.GlobalAveragePooling3D(), (2, 2, 2, 2)
        ),
        # Output sizes that do not divide the input: uneven windows.
        "AdaptiveAveragePooling1D": s(
            lambda L: L.AdaptiveAveragePooling1D(2), (5, 3)
        ),
        "AdaptiveMaxPooling1D": s(lambda L: L.AdaptiveMaxPooling1D(2), (5, 3)),
        "AdaptiveAveragePooling2D": s(
            lambda L: L.AdaptiveAveragePooling2D((2, 2)), (5, 5, 3)
        ),
        "AdaptiveMaxPooling2D": s(
            lambda L: L.AdaptiveMaxPooling2D((2, 2)), (5, 5, 3)
        ),
        "AdaptiveAveragePooling3D": s(
            lambda L: L.AdaptiveAveragePooling3D((2, 2, 2)), (3, 3, 3, 2)
        ),
        "AdaptiveMaxPooling3D": s(
            lambda L: L.AdaptiveMaxPooling3D((2, 2, 2)), (3, 3, 3, 2)
        ),
        # -- recurrent -------------------------------------------------
        "SimpleRNN": s(lambda L: L.SimpleRNN(4), _SEQ),
        "GRU": s(lambda L: L.GRU(4), _SEQ),
        "GRU-reset_after_false": s(lambda L: L.GRU(4, reset_after=False), _SEQ),
        "LSTM": s(lambda L: L.LSTM(4, return_sequences=True), _SEQ),
        "RNN": s(
            lambda L: L.RNN(
                L.LSTMCell(4), return_sequences=True, go_backwards=True
            ),
            _SEQ,
        ),
        "SimpleRNNCell": s(lambda L: L.RNN(L.SimpleRNNCell(4)), _SEQ),
        "GRUCell": s(lambda L: L.RNN(L.GRUCell(4)), _SEQ),
        "LSTMCell": s(lambda L: L.RNN(L.LSTMCell(4)), _SEQ),
        "StackedRNNCells": s(
            lambda L: L.RNN(
                L.StackedRNNCells(
                    [L.SimpleRNNCell(4), L.GRUCell(4), L.LSTMCell(4)]
                )
            ),
            _SEQ,
        ),
        "Bidirectional": s(
            lambda L: L.Bidirectional(L.LSTM(4, return_sequences=True)), _SEQ
        ),
        "TimeDistributed": s(lambda L: L.TimeDistributed(L.Dense(4)), _SEQ),
        "ConvLSTM1D": s(
            lambda L: L.ConvLSTM1D(2, 3, padding="same"), (3, 4, 2), units=2
        ),
        "ConvLSTM2D": s(
            lambda L: L.ConvLSTM2D(2, 3, padding="same"),
            (3, 4, 4, 2),
            units=2,
        ),
        "ConvLSTM3D": s(
            lambda L: L.ConvLSTM3D(2, 2, padding="same"),
            (2, 2, 2, 2, 2),
            units=2,
        ),
        # -- normalization ---------------------------------------------
        "BatchNormalization": s(
            lambda L: L.BatchNormalization(momentum=0.5), (5,), units=6
        ),
        "LayerNormalization": s(lambda L: L.LayerNormalization(), _SEQ),
        "GroupNormalization": s(lambda L: L.GroupNormalization(groups=2), _SEQ),
        "UnitNormalization": s(lambda L: L.UnitNormalization(), (5,), units=6),
        "RMSNormalization": s(lambda L: L.RMSNormalization(), (5,), units=6),
        "SpectralNormalization": s(
            lambda L: L.SpectralNormalization(L.Dense(6)), (5,), units=6
        ),
        "Normalization": s(
            lambda L: L.Normalization(mean=0.5, variance=2.0), _SEQ
        ),
        # -- attention -------------------------------------------------
        "Attention": s(lambda L: L.Attention(), _SEQ, call="list"),
        "AdditiveAttention": s(
            lambda L: L.AdditiveAttention(), _SEQ, call="list"
        ),
        "MultiHeadAttention": s(
            lambda L: L.MultiHeadAttention(num_heads=2, key_dim=2),
            _SEQ,
            call="pair",
        ),
        "GroupQueryAttention": s(
            lambda L: L.GroupQueryAttention(
                head_dim=2, num_query_heads=4, num_key_value_heads=2
            ),
            _SEQ,
            call="pair",
        ),
        # -- merging ---------------------------------------------------
        "Add": s(lambda L: L.Add(), _SEQ, call="list"),
        "Subtract": s(lambda L: L.Subtract(), _SEQ, call="list"),
        "Multiply": s(lambda L: L.Multiply(), _SEQ, call="list"),
        "Average": s(lambda L: L.Average(), _SEQ, call="list"),
        "Maximum": s(lambda L: L.Maximum(), _SEQ, call="list"),
        "Minimum": s(lambda L: L.Minimum(), _SEQ, call="list"),
        "Concatenate": s(lambda L: L.Concatenate(), _SEQ, call="list"),
        "Dot": s(lambda L: L.Dot(axes=1), _SEQ, call="list"),
        # -- reshaping -------------------------------------------------
        "Flatten": s(lambda L: L.Flatten(name="flatten_case"), (4, 3)),
        "Reshape": s(lambda L: L.Reshape((2, 8)), (4, 3)),
        "Permute": s(lambda L: L.Permute((2, 1)), (6, 3)),
        "RepeatVector": s(lambda L: L.RepeatVector(2), (5,)),
        "Cropping1D": s(lambda L: L.Cropping1D(1), (6, 3)),
        "Cropping2D": s(lambda L: L.Cropping2D(1), _IMG),
        "Cropping3D": s(lambda L: L.Cropping3D(1), (4, 4, 4, 2)),
        "ZeroPadding1D": s(lambda L: L.ZeroPadding1D(1), (4, 3)),
        "ZeroPadding2D": s(lambda L: L.ZeroPadding2D(1), (4, 4, 3)),
        "ZeroPadding3D": s(lambda L: L.ZeroPadding3D(1), (2, 2, 2, 2)),
        "UpSampling1D": s(lambda L: L.UpSampling1D(2), (3, 3)),
        "UpSampling2D": s(lambda L: L.UpSampling2D(2), (2, 2, 3)),
        "UpSampling3D": s(lambda L: L.UpSampling3D(2), (2, 2, 2, 2)),
        # -- regularization --------------------------------------------
        "Dropout": s(lambda L: L.Dropout(0.5, seed=_SEED), (5,), units=6),
        # Its noise comes from the seed that `set_random_seed` set.
        "Dropout-unseeded": s(lambda L: L.Dropout(0.5), (5,), units=6),
        "SpatialDropout1D": s(
            lambda L: L.SpatialDropout1D(0.5, seed=_SEED), _SEQ
        ),
        "SpatialDropout2D": s(
            lambda L: L.SpatialDropout2D(0.5, seed=_SEED), (4, 4, 3)
        ),
        "SpatialDropout3D": s(
            lambda L: L.SpatialDropout3D(0.5, seed=_SEED), (2, 2, 2, 2)
        ),
        "GaussianNoise": s(
            lambda L: L.GaussianNoise(0.1, seed=_SEED), (5,), units=6
        ),
        "GaussianDropout": s(
            lambda L: L.GaussianDropout(0.3, seed=_SEED), (5,), units=6
        ),
        "AlphaDropout": s(
            lambda L: L.AlphaDropout(0.3, seed=_SEED), (5,), units=6
        ),
        "ActivityRegularization": s(
            lambda L: L.ActivityRegularization(l1=0.01, l2=0.01),
            (5,),
            units=6,
        ),
        # -- preprocessing: numbers and tokens -------------------------
        "Rescaling": s(lambda L: L.Rescaling(0.5, offset=0.1), (5,), units=6),
        "CategoryEncoding": _tokens(
            lambda L: L.CategoryEncoding(VOCAB_SIZE, output_mode="multi_hot")
        ),
        "Discretization": Case(_discretization, (5,)),
        # Integer ids only: these run through TensorFlow ops.
        "Hashing": _tokens(lambda L: L.Hashing(8), ids=8),
        "IntegerLookup": _tokens(
            lambda L: L.IntegerLookup(vocabulary=list(range(1, 8))),
            ids=8,
        ),
        "MelSpectrogram": s(
            lambda L: L.MelSpectrogram(
                fft_length=8,
                sequence_stride=4,
                num_mel_bins=4,
                sampling_rate=100,
                # Magnitudes, not decibels: losses of a few units.
                power_to_db=False,
                mag_exp=1.0,
            ),
            (5,),
            units=32,
        ),
        # A window given as values: a window's name needs scipy, which
        # the test environment does not install.
        "STFTSpectrogram": s(
            lambda L: L.STFTSpectrogram(
                mode="magnitude",
                frame_length=8,
                frame_step=4,
                window=[0.5, 0.7, 0.9, 1.0, 1.0, 0.9, 0.7, 0.5],
                trainable=True,
            ),
            (16, 3),
            units=2,
        ),
        # -- preprocessing: images -------------------------------------
        "Resizing": image(lambda L: L.Resizing(4, 4)),
        "CenterCrop": image(lambda L: L.CenterCrop(4, 4)),
        "Pipeline": image(
            lambda L: L.Pipeline([L.RandomFlip(), L.Rescaling(0.5)])
        ),
        "RandomFlip": image(lambda L: L.RandomFlip()),
        "RandomRotation": image(lambda L: L.RandomRotation(0.2)),
        "RandomZoom": image(lambda L: L.RandomZoom(0.2)),
        "RandomTranslation": image(lambda L: L.RandomTranslation(0.2, 0.2)),
        "RandomCrop": image(lambda L: L.RandomCrop(4, 4), call="train"),
        "RandomShear": image(lambda L: L.RandomShear(0.2, 0.2)),
        "RandomPerspective": image(lambda L: L.RandomPerspective(0.5)),
        "RandomElasticTransform": image(
            lambda L: L.RandomElasticTransform(value_range=_RANGE)
        ),
        "RandomContrast": image(
            lambda L: L.RandomContrast(0.3, value_range=_RANGE)
        ),
        "RandomBrightness": image(
            lambda L: L.RandomBrightness(0.3, value_range=_RANGE)
        ),
        "RandomErasing": image(lambda L: L.RandomErasing(value_range=_RANGE)),
        "RandomGaussianBlur": image(
            lambda L: L.RandomGaussianBlur(value_range=_RANGE)
        ),
        "RandomGrayscale": image(lambda L: L.RandomGrayscale(0.5)),
        "RandomHue": image(lambda L: L.RandomHue(0.2, value_range=_RANGE)),
        "RandomSaturation": image(
            lambda L: L.RandomSaturation(0.2, value_range=_RANGE)
        ),
        "RandomSharpness": image(
            lambda L: L.RandomSharpness(0.2, value_range=_RANGE)
        ),
        "RandomInvert": image(
            lambda L: L.RandomInvert(0.5, value_range=_RANGE)
        ),
        "RandomPosterization": image(
            lambda L: L.RandomPosterization(4, value_range=_RANGE)
        ),
        "RandomColorDegeneration": image(
            lambda L: L.RandomColorDegeneration(0.3, value_range=_RANGE)
        ),
        "RandomColorJitter": image(
            lambda L: L.RandomColorJitter(
                value_range=_RANGE,
                brightness_factor=0.2,
                contrast_factor=0.2,
                saturation_factor=0.2,
                hue_factor=0.2,
            )
        ),
        "Solarization": image(
            lambda L: L.Solarization(
                addition_factor=0.2, threshold_factor=0.2, value_range=_RANGE
            )
        ),
        "AutoContrast": image(lambda L: L.AutoContrast(value_range=_RANGE)),
        "Equalization": image(
            lambda L: L.Equalization(value_range=_RANGE), call="train"
        ),
        "ContrastLimitedAdaptiveHistogramEqualization": image(
            lambda L: L.ContrastLimitedAdaptiveHistogramEqualization(
                value_range=_RANGE, tile_grid_size=(2, 2)
            )
        ),
        "AugMix": image(lambda L: L.AugMix(value_range=_RANGE)),
        "RandAugment": image(lambda L: L.RandAugment(value_range=_RANGE)),
        "CutMix": image(lambda L: L.CutMix()),
        "MixUp": image(lambda L: L.MixUp()),
        # Acts on bounding boxes only: images pass through.
        "MaxNumBoundingBoxes": image(lambda L: L.MaxNumBoundingBoxes(3)),
    }
    return cases


CASES = _cases()

# Names `keras.layers` exports for a class that a case covers under
# another name.
ALIASES = {
    "AvgPool1D": "AveragePooling1D",
    "AvgPool2D": "AveragePooling2D",
    "AvgPool3D": "AveragePooling3D",
    "MaxPool1D": "MaxPooling1D",
    "MaxPool2D": "MaxPooling2D",
    "MaxPool3D": "MaxPooling3D",
    "GlobalAvgPool1D": "GlobalAveragePooling1D",
    "GlobalAvgPool2D": "GlobalAveragePooling2D",
    "GlobalAvgPool3D": "GlobalAveragePooling3D",
    "GlobalMaxPool1D": "GlobalMaxPooling1D",
    "GlobalMaxPool2D": "GlobalMaxPooling2D",
    "GlobalMaxPool3D": "GlobalMaxPooling3D",
    "Convolution1D": "Conv1D",
    "Convolution2D": "Conv2D",
    "Convolution3D": "Conv3D",
    "Convolution1DTranspose": "Conv1DTranspose",
    "Convolution2DTranspose": "Conv2DTranspose",
    "Convolution3DTranspose": "Conv3DTranspose",
    "SeparableConvolution1D": "SeparableConv1D",
    "SeparableConvolution2D": "SeparableConv2D",
}

# Classes `keras.layers` exports that no case trains, and why.
NOT_CASES = {
    "Layer": "the base class of every layer",
    "Wrapper": "the base class of Bidirectional, TimeDistributed and "
    "SpectralNormalization, which have cases",
    "InputSpec": "not a layer: the input constraints layers declare",
    "InputLayer": "every case's keras.Input makes one",
    "JaxLayer": "wraps a JAX function: JAX backend only",
    "FlaxLayer": "wraps a Flax module: JAX backend only",
    "TFSMLayer": "loads a TensorFlow SavedModel: TensorFlow backend only",
    "StringLookup": "string inputs (tf.strings), which torch cannot hold",
    "TextVectorization": "string inputs (tf.strings), which torch cannot hold",
    "HashedCrossing": "crosses features given as a dict or tuple of "
    "columns, a tf.data preprocessing step; Hashing covers the hashing",
}


def covered_layers():
    """The `keras.layers` class names the cases cover."""
    return {case_layer(name) for name in CASES}


def exported_layer_classes():
    """The names of the classes `keras.layers` exports."""
    import inspect

    from keras import layers

    return {
        name
        for name in dir(layers)
        if not name.startswith("_") and inspect.isclass(getattr(layers, name))
    }


# --------------------------------------------------------------------------
# One case
# --------------------------------------------------------------------------


def build_model(name):
    """Builds case `name`'s model (set the seed and distribution first)."""
    from keras import layers

    case = CASES[name]
    return case.build(layers, case.input_shape)


def make_data(name, num_samples=NUM_SAMPLES):
    """Returns case `name`'s `(x, y)` numpy arrays (always the same).

    The targets depend on the inputs, so that training moves the weights
    the same way on every step.
    """
    case = CASES[name]
    rng = np.random.default_rng(0)
    shape = (num_samples,) + tuple(case.input_shape)
    if case.input_dtype == "int32":
        x = rng.integers(0, VOCAB_SIZE, size=shape).astype("int32")
    else:
        x = rng.uniform(-1.0, 1.0, size=shape).astype("float32")
        if case.zero_tail:
            x[::2, -2:] = 0.0
    flat = x.reshape(num_samples, -1)
    if case.loss == "sparse_ce":
        return x, ((flat[:, 0] + flat[:, -1]) % NUM_OUTPUTS).astype("int32")
    y = np.stack(
        [flat.mean(-1), flat[:, 0] * flat[:, -1], np.abs(flat).mean(-1)],
        axis=-1,
    )
    return x, y.astype("float32")


def variable_axes(shape, mode):
    """The layout of a float variable of `shape` under `mode`, as axes.

    Returns:
        A tuple of mesh axis names or None per dimension, or None when no
        dimension is divisible by 2 (the variable stays replicated).
    """
    divisible = [dim for dim, size in enumerate(shape) if size % 2 == 0]
    if not divisible:
        return None
    axes = [None] * len(shape)
    if mode == "mp_last":
        axes[divisible[-1]] = "model"
    elif mode == "mp_first":
        axes[divisible[0]] = "model"
    elif mode == "fsdp":
        axes[divisible[0]] = "batch"
    elif mode == "2x2":
        axes[divisible[-1]] = "model"
        if len(divisible) > 1:
            axes[divisible[0]] = "batch"
    else:
        raise ValueError(f"mode {mode!r} has no variable layouts")
    return tuple(axes)


def layout_rules(model, mode):
    """`{LayoutMap key: axes}` laying out `model`'s variables under `mode`.

    Every float variable of rank >= 1 with a dimension divisible by 2
    gets the exact-path key `re.escape(path)` (LayoutMap keys are regexes,
    matched whole).
    """
    rules = {}
    for variable in model.weights:
        if not variable.shape or "float" not in str(variable.dtype):
            continue
        axes = variable_axes(tuple(variable.shape), mode)
        if axes is None:
            continue
        key = re.escape(variable.path)
        if rules.setdefault(key, axes) != axes:
            raise ValueError(
                f"Two variables have the path {variable.path!r} and "
                "different shapes: a LayoutMap cannot tell them apart."
            )
    return rules


def _use_mode(mode, rules):
    """Sets the distribution of `mode` (the project's tests' builders)."""
    from tests import distributions

    if mode == "dp":
        return distributions.use_data_parallel()
    from keras import distribution

    num_devices = len(distribution.list_devices())
    if mode.startswith("auto"):
        shape = (2, 2) if mode == "auto_2x2" else (1, num_devices)
        return distribution.set_distribution(
            distribution.AutoModelParallel(
                device_mesh=distributions.device_mesh(shape)
            )
        )
    mesh_shape = {
        "mp_last": (1, num_devices),
        "mp_first": (1, num_devices),
        "fsdp": (num_devices, 1),
        "2x2": (2, 2),
    }[mode]
    return distributions.use_model_parallel(
        layout_rules=rules, mesh_shape=mesh_shape
    )


def run_case(name, mode, num_samples=NUM_SAMPLES):
    """Trains case `name` under `mode`; returns what it ended with.

    A collective under a distribution: every process must call it.

    Returns:
        A dict: "losses" (per epoch), "weights" (the global values of
        `model.get_weights()`), "paths" (of `model.weights`),
        "placements" (`{path: placements as text}`), "rules" (the
        LayoutMap rules the mode used) and "layer_classes" (the
        `keras.layers` names of the classes of the model's layers, nested
        ones included).
    """
    import keras

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; one of {MODES}")
    case = CASES[name]
    keras.distribution.set_distribution(None)
    rules = {}
    if mode.startswith("auto"):
        _use_mode(mode, rules)
    elif mode not in ("single", "dp"):
        # The variables' paths and shapes, from a build in one process.
        keras.utils.set_random_seed(SEED)
        rules = layout_rules(build_model(name), mode)
        keras.backend.clear_session()
        if not rules:
            # The run would be a replicated one, not model parallel.
            raise ValueError(f"case {name!r} has no variable to lay out")
        _use_mode(mode, rules)
    elif mode == "dp":
        _use_mode(mode, rules)
    keras.utils.set_random_seed(SEED)
    model = build_model(name)
    if case.loss == "mse":
        loss = "mse"
    else:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(
        optimizer=keras.optimizers.SGD(LEARNING_RATE),
        loss=loss,
        jit_compile=False,
    )
    x, y = make_data(name, num_samples)
    counter = None if mode == "single" else gather_counter()
    with counter or _no_counter():
        history = model.fit(
            x,
            y,
            batch_size=BATCH_SIZE,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=[] if counter is None else [counter.callback()],
        )
    return {
        "losses": [float(value) for value in history.history["loss"]],
        "weights": [np.array(w) for w in model.get_weights()],
        "paths": [v.path for v in model.weights],
        "placements": {
            v.path: str(tuple(getattr(v.value, "placements", ())))
            for v in model.weights
        },
        "rules": rules,
        "layer_classes": _exported_classes_in(model),
        "devices": variable_devices(model.weights),
        # Pristine Keras (the reference) has no probe.
        "path": "" if mode == "single" else train_path(model),
        # Bytes all-gathered in each train step (a list, one per step).
        "gathered_bytes": [] if counter is None else counter.per_step,
    }


def _no_counter():
    import contextlib

    return contextlib.nullcontext()


# The collectives that gather (c10d's and the functional ones DTensor
# issues), by the op's name without its namespace.
_GATHER_OPS = frozenset(
    (
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
        "allgather_",
        "_allgather_base_",
        "allgather_coalesced_",
        "allgather_into_tensor_coalesced_",
    )
)


def gather_counter():
    """A torch dispatch mode adding up the bytes each all-gather returns.

    Entered around `fit`; its `callback()` records the bytes of each train
    step in `per_step`. Under a 1-D mesh (`DataParallel`) every gather is
    over the batch axis.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    import keras

    class GatherCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.total = 0
            self.per_step = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if func.name().split("::")[-1].split(".")[0] in _GATHER_OPS:
                self.total += sum(
                    x.numel() * x.element_size() for x in _tensors_in(result)
                )
            return result

        def callback(self):
            counter = self

            class PerStep(keras.callbacks.Callback):
                def on_train_batch_begin(self, batch, logs=None):
                    self.start = counter.total

                def on_train_batch_end(self, batch, logs=None):
                    counter.per_step.append(counter.total - self.start)

            return PerStep()

    return GatherCounter()


def _tensors_in(value):
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [x for item in value for x in _tensors_in(item)]
    return []


def train_path(model):
    """Which path the train step called `model` on, as text.

    `"local"` (each process' rows, as plain tensors), `"dtensor: <why>"`
    (the probe's reason), or `""` without a data-parallel probe.
    """
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


def variable_devices(variables):
    """Where the values of `variables` live, as sorted texts.

    Returns:
        The distinct `"cuda"` / `"cpu"` of plain tensors and, for a
        DTensor, its mesh's device type and its local shard's, e.g.
        `"cuda/cuda"`.
    """
    devices = set()
    for variable in variables:
        value = variable.value
        mesh = getattr(value, "device_mesh", None)
        if mesh is None:
            devices.add(value.device.type)
        else:
            devices.add(f"{mesh.device_type}/{value.to_local().device.type}")
    return sorted(devices)


def _exported_classes_in(model):
    """The names `keras.layers` exports of the classes of `model`'s layers.

    Export names, not `__name__`s: `GroupQueryAttention` is the class
    `GroupedQueryAttention`.
    """
    from keras import layers

    flat = list(model._flatten_layers())
    return sorted(
        name
        for name in exported_layer_classes()
        if any(isinstance(layer, getattr(layers, name)) for layer in flat)
    )


def error_kind(error):
    """`"Type: first line of the message"` of an exception.

    Keras re-raises an error of a layer call as "Exception encountered
    when calling X.call()." followed by the original message (in ANSI
    bold): the first line of that message is taken instead.
    """
    text = str(error)
    if text.startswith("Exception encountered when"):
        # Nested layer calls nest these: the innermost message is the last.
        text = text.split("\x1b[1m")[-1]
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines and not lines[0].startswith("Arguments received by"):
        return f"{type(error).__name__}: {lines[0]}"[:300]
    # No message (a bare `assert`): where it was raised.
    frame = traceback.extract_tb(error.__traceback__)[-1]
    where = f"{os.path.basename(frame.filename)}:{frame.name}"
    return f"{type(error).__name__} in {where}"


def guarded_run(name, mode, num_samples=NUM_SAMPLES):
    """`run_case`, with an exception recorded as the case's result.

    Returns:
        `run_case`'s dict, or `{"error": error_kind, "traceback": ...}`;
        either way with the case's "seconds". The distribution is cleared
        and the session reset after the case.
    """
    import time

    import keras

    start = time.monotonic()
    try:
        result = run_case(name, mode, num_samples)
    except Exception as error:
        frames = traceback.format_exception(error)
        result = {
            "error": error_kind(error),
            # The innermost frames say where it failed.
            "traceback": "".join(frames[-6:])[-3000:],
        }
    finally:
        keras.distribution.set_distribution(None)
        keras.backend.clear_session()
    result["seconds"] = time.monotonic() - start
    return result


# --------------------------------------------------------------------------
# A mode's run: all its cases in one process group
# --------------------------------------------------------------------------


class GroupOutOfStep(RuntimeError):
    """After a failed case, the processes' collectives no longer match."""


def _result_path(out_dir, name, rank):
    return os.path.join(out_dir, f"{name}.rank{rank}.pkl")


def _progress_path(out_dir, rank):
    return os.path.join(out_dir, f"progress.rank{rank}")


def _write(path, data):
    # Whole or absent: the parent may read it after this process is killed.
    with open(path + ".tmp", "wb") as file:
        file.write(data)
    os.replace(path + ".tmp", path)


def mode_body(rank, world_size, mode, names, out_dir, num_samples):
    """Runs cases `names` under `mode`, one after the other (harness body).

    See `run_cases`.

    Returns:
        The number of cases run.
    """
    return run_cases(
        rank,
        names,
        out_dir,
        lambda name: guarded_run(name, mode, num_samples),
        case_timeout=CASE_TIMEOUT,
    )


def run_cases(
    rank,
    names,
    out_dir,
    run_one,
    *,
    collective_timeout=COLLECTIVE_TIMEOUT,
    case_timeout=None,
):
    """Runs `run_one(name)` for each of `names`, in one process group.

    Each case's result (`run_one`'s dict) is written to `out_dir` as soon
    as it is known, so that what ran survives a later case that hangs; the
    case running now is in `progress.rank<N>`. After a case that failed on
    any process, the processes check that the collectives of every process
    group still line up (a case may fail on one process in the middle of
    a collective the others wait in); if not, `GroupOutOfStep` ends the
    call, and `run_mode` resumes in a fresh process group.

    Args:
        rank: this process' rank.
        names: the cases.
        out_dir: where results go (see `run_mode`).
        run_one: `run_one(name)` runs one case, returns its result.
        collective_timeout: the bound of every collective of a case.
        case_timeout: if set, a watchdog: a case still running after this
            many seconds writes the stacks of this process' threads to
            `watchdog.rank<N>` and ends the process, so that `run_mode`
            fails that case alone at once (not at the call's deadline) and
            goes on with the next ones in a fresh process group.

    Returns:
        The number of cases run.
    """
    import datetime
    import faulthandler
    import pickle

    import torch.distributed as dist

    # Every collective of a case waits at most this long: a case stuck in
    # one fails instead of the call (Keras bounds its groups by these).
    os.environ["KERAS_DISTRIBUTION_TIMEOUT"] = str(collective_timeout)
    os.environ["KERAS_DISTRIBUTION_START_TIMEOUT"] = str(collective_timeout)
    # The processes agree between cases in a group of their own, which no
    # case uses, so that it lines up whatever the cases did.
    agreement = dist.new_group(
        backend="gloo",
        timeout=datetime.timedelta(seconds=3 * collective_timeout),
    )
    watchdog = open(_watchdog_path(out_dir, rank), "w")
    try:
        for name in names:
            _write(_progress_path(out_dir, rank), name.encode())
            if case_timeout is not None:
                faulthandler.dump_traceback_later(
                    case_timeout, exit=True, file=watchdog
                )
            try:
                result = run_one(name)
            finally:
                faulthandler.cancel_dump_traceback_later()
            _write(_result_path(out_dir, name, rank), pickle.dumps(result))
            _check_in_step(name, "error" in result, agreement)
    finally:
        watchdog.close()
        dist.destroy_process_group(agreement)
    return len(names)


def _watchdog_path(out_dir, rank):
    return os.path.join(out_dir, f"watchdog.rank{rank}")


def _check_in_step(name, failed, agreement):
    """Raises `GroupOutOfStep` if a failed case left the groups unaligned."""
    import torch.distributed as dist

    world_size = dist.get_world_size()
    failures = [None] * world_size
    dist.all_gather_object(failures, failed, group=agreement)
    if not any(failures):
        return
    try:
        # Every group this process is in, in the same order everywhere.
        for group in _job_groups():
            dist.barrier(group=group)
        in_step = ""
    except RuntimeError as error:
        in_step = error_kind(error)
    answers = [None] * world_size
    dist.all_gather_object(answers, in_step, group=agreement)
    if any(answers):
        raise GroupOutOfStep(
            f"After case {name!r} (failed on processes "
            f"{[r for r, f in enumerate(failures) if f]}), the process "
            f"groups are out of step: {answers}"
        )


def _job_groups():
    """The default process group and those of the meshes made so far."""
    from keras.src.backend.torch.distributed.core import layouts

    return layouts.all_process_groups()


def run_mode(
    mode,
    world_size,
    names=None,
    *,
    num_samples=NUM_SAMPLES,
    log=None,
    body=None,
    call_timeout=None,
):
    """Runs the cases `names` (default all) under `mode` on gloo processes.

    All the cases run in one `run_on_ranks` call, one after the other. A
    case that fails on every process is that case's result; a case that
    hangs or leaves the process groups out of step fails too, and the
    remaining cases go on in a fresh process group.

    Args:
        mode: one of `MODES` but "single".
        world_size: the number of processes.
        names: the case names, default all of `CASES`.
        num_samples: the number of samples (23: a ragged last batch).
        log: `log(text)` is told of each restart.
        body: the harness body, default `mode_body` (tests of this
            function give one that adds cases of their own).
        call_timeout: the bound of each call in seconds, default
            `CALL_TIMEOUT_BASE` plus `CALL_TIMEOUT_PER_CASE` per case.

    Returns:
        `{name: [per-rank result]}`, see `guarded_run`.
    """
    import shutil
    import tempfile

    from tests import harness

    remaining = list(CASES if names is None else names)
    results = {}
    out_dir = tempfile.mkdtemp(prefix=f"catalogue-{mode}-{world_size}-")
    try:
        while remaining:
            failure = None
            try:
                harness.run_on_ranks(
                    body or mode_body,
                    world_size=world_size,
                    args=(mode, remaining, out_dir, num_samples),
                    timeout=call_timeout
                    or CALL_TIMEOUT_BASE
                    + CALL_TIMEOUT_PER_CASE * len(remaining),
                )
            except harness.MultiRankError as error:
                failure = error
            for name in remaining:
                paths = [
                    _result_path(out_dir, name, rank)
                    for rank in range(world_size)
                ]
                if all(os.path.exists(path) for path in paths):
                    results[name] = [_load(path) for path in paths]
            if failure is None:
                break
            remaining = _resume_after(
                failure, remaining, results, out_dir, world_size
            )
            if log is not None:
                log(
                    f"{mode} on {world_size}: restarting with "
                    f"{len(remaining)} cases after {str(failure)[:200]}"
                )
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return results


def _watchdog_stacks(out_dir, world_size):
    """The stacks a case's watchdog wrote (see `run_cases`), then clears
    them: `""` when no watchdog fired."""
    stacks = ""
    for rank in range(world_size):
        path = _watchdog_path(out_dir, rank)
        if os.path.exists(path):
            with open(path) as file:
                text = file.read()
            os.remove(path)
            if text.strip():
                stacks += f"rank {rank}, at its watchdog:\n{text}\n"
    return stacks


def _load(path):
    import pickle

    with open(path, "rb") as file:
        return pickle.load(file)


def _resume_after(failure, remaining, results, out_dir, world_size):
    """The cases left after a failed call; records the case that broke it.

    The case that was running on some process without a result on every
    process hung (or its process died): it fails with the call's report.
    """
    running = set()
    for rank in range(world_size):
        path = _progress_path(out_dir, rank)
        if os.path.exists(path):
            with open(path) as file:
                running.add(file.read())
            os.remove(path)
    watchdog = _watchdog_stacks(out_dir, world_size)
    pending = [name for name in remaining if name not in results]
    if pending and pending[0] in running:
        stuck = pending.pop(0)
        report = str(failure)
        first = (
            "the call failed while this case ran: "
            + (report.splitlines()[0][:200])
        )
        if watchdog:
            first = "its watchdog ended it"
        stacks = watchdog[-6000:]
        results[stuck] = [
            {
                "error": "Hang: " + first,
                # The stacks of the ranks at the deadline (the watchdog's,
                # or the call's). The call's report ends with the workers'
                # output, which earlier calls of a reused worker may have
                # filled: it gets what the watchdog's stacks leave.
                "traceback": stacks + report[len(stacks) - 8000 :],
            }
        ] * world_size
    elif len(pending) == len(remaining):
        # Nothing ran: the pool itself failed. Do not loop.
        raise failure
    return pending


# --------------------------------------------------------------------------
# The reference: one process, pristine upstream Keras
# --------------------------------------------------------------------------

# The cases that draw random numbers in training. Under a distribution the
# torch backend draws by position (`random_draws`), not from torch's
# generators: their reference is the same case on one process under
# `DataParallel` (`one_process_reference`), whose numbers any layout must
# give.
RANDOM_CASES = tuple(
    (
        "Dropout Dropout-unseeded SpatialDropout1D SpatialDropout2D "
        "SpatialDropout3D GaussianNoise GaussianDropout AlphaDropout "
        "Pipeline RandomFlip RandomRotation RandomZoom RandomTranslation "
        "RandomCrop RandomShear RandomPerspective RandomElasticTransform "
        "RandomContrast RandomBrightness RandomErasing RandomGaussianBlur "
        "RandomGrayscale RandomHue RandomSaturation RandomSharpness "
        "RandomInvert RandomPosterization RandomColorDegeneration "
        "RandomColorJitter Solarization AugMix RandAugment CutMix MixUp"
    ).split()
)


def one_process_reference(names, num_samples=NUM_SAMPLES):
    """Cases `names` on one process under `DataParallel`, this build.

    Returns:
        `{name: result}`, as `compute_reference`'s "results".
    """
    results = run_mode("dp", 1, names, num_samples=num_samples)
    return {name: per_rank[0] for name, per_rank in results.items()}


def full_reference(names, num_samples=NUM_SAMPLES):
    """The reference of each case: pristine Keras on one process, and for
    `RANDOM_CASES` this build on one process under `DataParallel`.

    Returns:
        `compute_reference`'s dict, with `"one_process_cases"` added: the
        names whose results come from `one_process_reference`.
    """
    random_names = [n for n in names if n in RANDOM_CASES]
    others = [n for n in names if n not in RANDOM_CASES]
    if others:
        reference = compute_reference(others, num_samples=num_samples)
    else:
        reference = {"results": {}}
    if random_names:
        reference["results"].update(
            one_process_reference(random_names, num_samples)
        )
    reference["one_process_cases"] = random_names
    return reference


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run by `compute_reference` in a fresh interpreter whose `keras` is
# pristine upstream: loads this file by path (the project's `tests`
# package is not importable there, and need not be).
_REFERENCE_SCRIPT = r"""
import importlib.util, os, sys
os.environ["KERAS_BACKEND"] = "torch"
import torch
torch.set_num_threads(1)
path, out, num_samples = sys.argv[1], sys.argv[2], int(sys.argv[3])
names = sys.argv[4:]

def load(path):
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

# This module first: the catalogue at `path` may use its helpers.
load(os.path.join(os.path.dirname(path), "layer_catalogue.py"))
load(path).write_reference(out, names or None, num_samples)
"""


def write_reference(path, names=None, num_samples=NUM_SAMPLES, run_one=None):
    """Runs cases `names` (default all) in this process, pickles them.

    The file holds `{"results": {name: result}, "keras_file": ...,
    "keras_version": ..., "torch_version": ...}`, so that the caller can
    check which Keras computed it.

    Args:
        path: the file.
        names: the cases, default all of `CASES`.
        num_samples: the number of samples of each case.
        run_one: `run_one(name)` runs a case with no distribution, default
            `guarded_run(name, "single", num_samples)` (another catalogue
            gives its own).
    """
    import pickle

    import torch

    import keras

    if run_one is None:

        def run_one(name):
            return guarded_run(name, "single", num_samples)

    results = {
        name: run_one(name) for name in (CASES if names is None else names)
    }
    _write(
        path,
        pickle.dumps(
            {
                "results": results,
                "keras_file": keras.__file__,
                "keras_version": keras.__version__,
                "torch_version": torch.__version__,
            }
        ),
    )


def pristine_keras_root():
    """The directory holding pristine upstream `keras` (downloaded once)."""
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, os.path.join(_REPO, "build_backend"))
    try:
        overlaylib = importlib.import_module("overlaylib")
    finally:
        sys.path.pop(0)
    version = overlaylib.upstream_version(
        overlaylib.project_table(_REPO)["version"]
    )
    return Path(
        overlaylib.pristine_upstream(
            version, Path(_REPO) / "build" / "upstream"
        )
    )


def compute_reference(
    names=None,
    *,
    num_samples=NUM_SAMPLES,
    timeout=900,
    module_file=None,
    env=None,
):
    """Cases `names` (default all) in one fresh interpreter, pristine Keras.

    Pristine upstream Keras 3.15.1 comes first on `PYTHONPATH`, with the
    torch backend and one thread; every case runs with no distribution.
    `module_file` is the catalogue whose `write_reference` runs them
    (default this one), loaded by path: it imports nothing of the project.
    `env` adds to its environment (e.g. the GPUs it may use).

    Returns:
        `write_reference`'s dict; its "keras_file" is checked to be under
        the pristine root.
    """
    import pickle
    import subprocess
    import sys
    import tempfile

    root = pristine_keras_root()
    env = dict(
        os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1", **(env or {})
    )
    env["PYTHONPATH"] = str(root)
    with tempfile.TemporaryDirectory(prefix="catalogue-reference-") as tmp:
        out = os.path.join(tmp, "reference.pkl")
        process = subprocess.run(
            [
                sys.executable,
                "-c",
                _REFERENCE_SCRIPT,
                module_file or os.path.abspath(__file__),
                out,
                str(num_samples),
                *(names or ()),
            ],
            env=env,
            # Not the repository: its `keras/` (our overlay) must not shadow.
            cwd="/",
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if process.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(
                f"the pristine reference run failed ({process.returncode}):"
                f"\n{process.stderr[-4000:]}"
            )
        with open(out, "rb") as file:
            reference = pickle.load(file)
    keras_file = os.path.realpath(reference["keras_file"])
    if not keras_file.startswith(os.path.realpath(root) + os.sep):
        raise RuntimeError(
            f"the reference ran {keras_file}, not pristine Keras in {root}"
        )
    return reference


# --------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------


def compare(per_rank, reference):
    """How a case's per-rank results differ from one process' result.

    Args:
        per_rank: the case's results, one per rank (see `guarded_run`).
        reference: the case's "single" result from pristine Keras.

    Returns:
        A list of problems (text), empty when every rank ran, equals the
        reference (losses: `LOSS_RTOL`/`LOSS_ATOL`; weights:
        `WEIGHT_RTOL`/`WEIGHT_ATOL`) and the others, and every variable
        with a layout rule was sharded.
    """
    if "error" in reference:
        return [f"the one-process reference failed: {reference['error']}"]
    errors = [result.get("error") for result in per_rank]
    if any(errors):
        if len(set(errors)) == 1:
            return [f"every rank raised {errors[0]}"]
        return [f"rank {r}: {error or 'ran'}" for r, error in enumerate(errors)]
    problems = []
    for rank, result in enumerate(per_rank):
        problems += [
            f"rank {rank}: {p}" for p in _differences(result, reference)
        ]
    for rank, result in enumerate(per_rank[1:], start=1):
        problems += [
            f"rank {rank} vs rank 0: {p}"
            for p in _differences(result, per_rank[0])
        ]
    for rank, result in enumerate(per_rank):
        unsharded = [
            path
            for path in result["paths"]
            if re.escape(path) in result["rules"]
            and "Shard" not in result["placements"][path]
        ]
        if unsharded:
            problems.append(
                f"rank {rank}: variables with a layout rule stayed "
                f"replicated: {unsharded}"
            )
    return problems


def _differences(result, expected):
    """The ways `result`'s numbers differ from `expected`'s (text).

    Weights are compared in `model.get_weights()` order, not by path: this
    package names a `TorchModuleWrapper`'s variables after the torch
    parameters (`weight`, `bias`), pristine Keras `variable`,
    `variable_1`.
    """
    if len(result["weights"]) != len(expected["weights"]):
        return [f"variables {result['paths']} != {expected['paths']}"]
    problems = []
    try:
        np.testing.assert_allclose(
            result["losses"],
            expected["losses"],
            rtol=LOSS_RTOL,
            atol=LOSS_ATOL,
        )
    except AssertionError as error:
        problems.append(f"losses differ: {_mismatch(error)}")
    for path, actual, wanted in zip(
        expected["paths"], result["weights"], expected["weights"]
    ):
        try:
            np.testing.assert_allclose(
                actual, wanted, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL
            )
        except AssertionError as error:
            problems.append(f"weights {path} differ: {_mismatch(error)}")
    return problems


def _mismatch(error):
    """The mismatch and largest differences of an `assert_allclose`."""
    lines = [line.strip() for line in str(error).splitlines()]
    kept = [
        line
        for line in lines
        if line.startswith(("Mismatched", "Max absolute", "Max relative"))
        or line.startswith(("ACTUAL", "DESIRED"))
    ]
    return "; ".join(kept)[:400]


def failure_kind(per_rank, reference):
    """A short kind of a case's failure, or None when it equals the reference.

    The first error of any rank (see `error_kind`), "numbers differ" or
    the first other problem `compare` found, its digits replaced by "#"
    so that failures that differ only in sizes group together. An error
    of its own comes before a `JobFailedError`, which only says that
    another process failed.
    """
    problems = compare(per_rank, reference)
    if not problems:
        return None
    errors = [result["error"] for result in per_rank if "error" in result]
    if "error" in reference:
        kind = f"reference failed: {reference['error']}"
    elif errors:
        own = [e for e in errors if not e.startswith("JobFailedError")]
        kind = (own or errors)[0]
        if len(errors) < len(per_rank):
            kind = f"on some ranks only: {kind}"
    elif any("differ" in problem for problem in problems):
        kind = "numbers differ from one process"
    else:
        kind = problems[0]
    return re.sub(r"\d+", "#", kind)


def known_failure_params(pairs, known_failures, timeout, raises):
    """pytest parameters for `(run, case)` pairs, each bounded by `timeout`;
    those in `known_failures` are strict xfails that must raise `raises`
    (a case that passes, or fails another way, fails the test)."""
    import pytest

    params = []
    for run, name in pairs:
        marks = [pytest.mark.timeout(timeout)]
        kind = known_failures.get((run, name))
        if kind is not None:
            marks.append(
                pytest.mark.xfail(strict=True, raises=raises, reason=kind)
            )
        params.append(pytest.param(run, name, marks=marks))
    return params
