"""XLA for tfdist.fit's step (tfdist.training.checks.resolve_jit): "auto" as Keras resolves it, clear refusals.

No GPU here: Keras' own "auto" resolution at ``compile`` is made to see a GPU
(it lists the physical devices), and tfdist's side gets a stand-in backend
whose device_kind is "gpu".
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.distribute.backend import Backend
from tfdist.distribute.cluster import ClusterInfo
from tfdist.training.checks import resolve_jit


def gpu_backend():
    return Backend("default", tf.distribute.get_strategy(), "gpu")


def cpu_workers_backend():
    cluster = ClusterInfo("TF_CONFIG", {"worker": ("localhost:1", "localhost:2")}, "worker", 0)
    return Backend("multi_worker_mirrored", tf.distribute.get_strategy(), "cpu", cluster=cluster)


def dense_model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="out")])


def lookup_model():
    """IntegerLookup has supports_jit=False (a hash table: no XLA kernel)."""
    return keras.Sequential([keras.Input((1,), dtype="int64"), keras.layers.IntegerLookup(vocabulary=[1, 2, 3],
                                                                                          name="ids"),
                             keras.layers.Embedding(5, 3), keras.layers.Flatten(), keras.layers.Dense(2)])


def compiled_on_a_gpu_machine(model, monkeypatch, **compile_args):
    """compile() as on a machine with a GPU: Keras' "auto" resolution then turns XLA on where the model allows."""
    devices = [tf.config.PhysicalDevice("/physical_device:CPU:0", "CPU"),
               tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")]
    with monkeypatch.context() as patch:
        patch.setattr(tf.config, "list_physical_devices", lambda *args: devices)
        model.compile(optimizer="sgd", loss="mse", **compile_args)
    return model


def test_auto_follows_keras_resolution_of_the_model(monkeypatch):
    assert compiled_on_a_gpu_machine(dense_model(), monkeypatch).jit_compile is True  # Keras' own choice.
    assert resolve_jit("auto", gpu_backend(), compiled_on_a_gpu_machine(dense_model(), monkeypatch)) is True
    # compile(jit_compile=False) is the user's word.
    assert resolve_jit("auto", gpu_backend(),
                        compiled_on_a_gpu_machine(dense_model(), monkeypatch, jit_compile=False)) is False
    # A layer without XLA support: Keras resolves "auto" to False, and so does tfdist.
    with pytest.warns(UserWarning, match="Model doesn't support `jit_compile=True`"):
        forced = compiled_on_a_gpu_machine(lookup_model(), monkeypatch, jit_compile=True)
    assert forced.jit_compile is False
    assert resolve_jit("auto", gpu_backend(), compiled_on_a_gpu_machine(lookup_model(), monkeypatch)) is False
    # On this CPU-only machine Keras resolves "auto" to False: so does tfdist.
    plain = dense_model()
    plain.compile(optimizer="sgd", loss="mse")
    assert resolve_jit("auto", gpu_backend(), plain) is False
    # Where tfdist cannot run XLA, "auto" stays off rather than failing.
    assert resolve_jit("auto", cpu_workers_backend(), compiled_on_a_gpu_machine(dense_model(), monkeypatch)) is False


def test_true_with_a_layer_without_xla_support_is_refused_before_any_step():
    tfdist.make_strategy("default", precision="float32")
    model = lookup_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = np.array([[1], [2], [3], [9]] * 8, "int64"), np.zeros((32, 2), "float32")
    expected = ("jit_compile=True, but the model cannot be compiled with XLA: layer(s) ids (IntegerLookup) do not "
                "support XLA (supports_jit=False). Keras' fit would warn and train without XLA; pass "
                "jit_compile='auto' or False to tfdist.fit.")
    with pytest.raises(tfdist.UserError) as raised:
        tfdist.fit(model, x, y, batch_size=8, epochs=1, jit_compile=True, verbose=0)
    assert str(raised.value) == expected
    assert int(model.optimizer.iterations.numpy()) == 0


def test_true_on_a_multi_worker_cpu_job_is_refused():
    model = dense_model()
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(tfdist.UserError) as raised:
        resolve_jit(True, cpu_workers_backend(), model)
    assert str(raised.value) == (
        "XLA (jit_compile=True) on a multi-worker CPU job (2 workers) is refused: TensorFlow aborts the workers "
        "(SIGABRT, double free) in XLA-compiled collectives on CPUs. Use jit_compile='auto' or False on CPUs (XLA "
        "is also slower there), or XLA on GPU workers.")
    assert resolve_jit(True, gpu_backend(), model) is True  # One process, one device: honoured.
