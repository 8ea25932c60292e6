"""tfdist.training.inputs: the topology-independent training order and exact evaluation, on real digits."""

import hashlib

import numpy as np
import pytest
import tensorflow as tf

from tfdist.mnist import data
from tfdist.training import inputs

DIGITS = data.load_dataset("mnist")
ARRAYS = inputs.Arrays(DIGITS.train_images, DIGITS.train_labels)
STEPS = DIGITS.num_train // 128


def keys(images):
    return [hashlib.sha1(np.asarray(im).tobytes()).hexdigest() for im in images]


def global_batches(pipelines, replicas, *, start=0, steps=STEPS, seed=1, total=None):
    """The global batch of every step, put together from every pipeline's replica batches in replica order."""
    per_replica = 128 // replicas
    fn = inputs.train_arrays_fn(ARRAYS, per_replica_batch=per_replica, steps_per_epoch=STEPS, seed=seed,
                                start_step=start, total_steps=total)
    here = replicas // pipelines
    streams = []
    for i in range(pipelines):
        dataset = fn(tf.distribute.InputContext(pipelines, i, replicas))
        assert [tuple(s.shape.as_list()) for s in dataset.element_spec] == [(per_replica, 28, 28, 1),
                                                                            (per_replica,)]
        streams.append([b[1].numpy() for b in dataset.take(steps * here)])
    return [np.concatenate([streams[p][s * here + j] for p in range(pipelines) for j in range(here)])
            for s in range(steps)]


def test_every_topology_trains_on_the_same_examples_at_every_step():
    one = global_batches(1, 1)
    for pipelines, replicas in ((1, 2), (1, 4), (2, 2), (2, 4), (4, 4)):
        other = global_batches(pipelines, replicas)
        assert len(other) == len(one) == STEPS
        for a, b in zip(one, other):
            np.testing.assert_array_equal(a, b)


def test_an_epoch_is_a_permutation_and_epochs_differ():
    fn = inputs.train_arrays_fn(ARRAYS, per_replica_batch=128, steps_per_epoch=STEPS, seed=1)
    dataset = fn(tf.distribute.InputContext())
    images = [b[0].numpy() for b in dataset.take(2 * STEPS)]
    first, second = np.concatenate(images[:STEPS]), np.concatenate(images[STEPS:])
    assert len(set(keys(first))) == len(first) == STEPS * 128  # No digit twice in an epoch.
    assert keys(first) != keys(second)
    seeded = [b[0].numpy() for b in inputs.train_arrays_fn(ARRAYS, per_replica_batch=128, steps_per_epoch=STEPS,
                                                            seed=2)(tf.distribute.InputContext()).take(1)]
    assert keys(seeded[0]) != keys(images[0])


def test_resume_skips_exactly_even_on_another_topology():
    full = global_batches(1, 1, steps=100, total=100)
    resumed = global_batches(2, 4, start=70, steps=30, total=100)
    assert len(resumed) == 30
    for a, b in zip(full[70:], resumed):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static-shapes"])
@pytest.mark.parametrize("pipelines, replicas_per_pipeline, n", [(1, 3, 1001), (2, 1, 999), (3, 2, 2000)])
def test_eval_counts_every_example_exactly_once(pipelines, replicas_per_pipeline, n, static):
    ids = np.arange(n)
    images = np.zeros((n, 28, 28, 1), np.uint8)
    images[:, 0, 0, 0], images[:, 0, 1, 0] = ids % 256, ids // 256
    per_replica, replicas = 64, pipelines * replicas_per_pipeline
    steps = inputs.eval_steps(n, per_replica, replicas)
    fn = inputs.eval_arrays_fn(inputs.Arrays(images, (ids % 10).astype(np.int32)), per_replica_batch=per_replica,
                               steps=steps, static_shapes=static)
    counted = []
    for i in range(pipelines):
        dataset = fn(tf.distribute.InputContext(pipelines, i, replicas))
        if static:
            assert all(None not in s.shape.as_list() for s in dataset.element_spec), dataset.element_spec
        batches = list(dataset)
        assert len(batches) == steps * replicas_per_pipeline  # Same count on every pipeline.
        for image, _, mask in batches:  # No sample weight given: none in the element.
            kept = image.numpy()[mask.numpy() > 0]
            assert (static and image.shape[0] == per_replica) or (not static and mask.numpy().all())
            counted += list(kept[:, 0, 0, 0].astype(int) + 256 * kept[:, 0, 1, 0].astype(int))
    assert sorted(counted) == list(range(n))
