"""tfdist.data: the data sources and the sharded, resumable, padded pipelines."""

import hashlib
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets.testing as tfds_testing

from tests.idx_files import write_mnist_dir
from tfdist import data
from tfdist.errors import UserError


def contexts(n):
    return [tf.distribute.InputContext(num_input_pipelines=n, input_pipeline_id=i, num_replicas_in_sync=n)
            for i in range(n)]


def image_keys(images):
    return [hashlib.sha1(np.asarray(im).tobytes()).hexdigest() for im in images]


def test_bundled_split_is_fixed_and_disjoint():
    d = data.load_dataset("mnist")
    assert (d.num_train, d.num_eval) == (8000, 2000)
    train, held = set(image_keys(d.train_images)), set(image_keys(d.eval_images))
    assert not train & held, "an eval digit is also in the training split"
    # Every fifth digit of the real MNIST test split (the bundled files; test_idx checks they are the
    # published ones) is held out, the others train, in order.
    real = data.idx.read_images_and_labels(os.path.join(data.BUNDLED_DIR, "t10k-images-idx3-ubyte.gz"),
                                           os.path.join(data.BUNDLED_DIR, "t10k-labels-idx1-ubyte.gz"))
    held_out = np.arange(10000) % 5 == 4
    np.testing.assert_array_equal(d.eval_images, real[0][held_out])
    np.testing.assert_array_equal(d.eval_labels, real[1][held_out])
    np.testing.assert_array_equal(d.train_images, real[0][~held_out])
    np.testing.assert_array_equal(d.train_labels, real[1][~held_out])


def test_train_shards_are_disjoint_and_cover_an_epoch_on_real_digits():
    d = data.load_dataset("mnist")
    assert len(set(image_keys(d.train_images))) == d.num_train  # Keys identify digits.
    steps = 8000 // 128
    fn = data.train_dataset_fn(d.train_images, d.train_labels, per_replica_batch=64,
                               steps_per_epoch=steps, seed=1)
    seen = []
    for ctx in contexts(2):
        batches = list(fn(ctx).take(steps))
        assert all(b[0].shape == (64, 28, 28, 1) for b in batches)  # B/2 per worker per step.
        seen.append(set(image_keys(np.concatenate([b[0] for b in batches]))))
        assert len(seen[-1]) == steps * 64
    assert not seen[0] & seen[1], "two workers trained on the same digit"


def test_epochs_reshuffle_and_resume_skips_exactly():
    d = data.load_dataset("mnist")
    fn = lambda start: data.train_dataset_fn(d.train_images, d.train_labels, per_replica_batch=100,  # noqa: E731
                                             steps_per_epoch=80, seed=3, start_step=start)
    ctx = contexts(1)[0]
    full = [b[1].numpy() for b in fn(0)(ctx).take(200)]
    resumed = [b[1].numpy() for b in fn(123)(ctx).take(77)]
    assert (len(full), len(resumed)) == (200, 77)  # zip() below would quietly compare fewer.
    for a, b in zip(full[123:], resumed):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(np.concatenate(full[:80]), np.concatenate(full[80:160]))  # Reshuffled.
    np.testing.assert_array_equal(np.sort(np.concatenate(full[:80])), np.sort(d.train_labels))


@pytest.mark.parametrize("pipelines, replicas_per_pipeline, n", [(1, 3, 1001), (2, 1, 999), (3, 2, 2000)])
def test_eval_counts_every_example_exactly_once(pipelines, replicas_per_pipeline, n):
    ids = np.arange(n)
    images = np.zeros((n, 28, 28, 1), np.uint8)
    images[:, 0, 0, 0], images[:, 0, 1, 0] = ids % 256, ids // 256
    labels = (ids % 10).astype(np.int32)
    per_replica, replicas = 64, pipelines * replicas_per_pipeline
    steps = -(-n // (per_replica * replicas))
    fn = data.eval_dataset_fn(images, labels, per_replica_batch=per_replica, steps=steps)
    counted = []
    for i in range(pipelines):
        ctx = tf.distribute.InputContext(pipelines, i, replicas)
        batches = list(fn(ctx))
        assert len(batches) == steps * replicas_per_pipeline  # Same static count on every pipeline.
        for image, _, weight in batches:
            assert image.shape == (per_replica, 28, 28, 1)
            kept = image.numpy()[weight.numpy() > 0]
            counted += list(kept[:, 0, 0, 0].astype(int) + 256 * kept[:, 0, 1, 0].astype(int))
    assert sorted(counted) == list(range(n))


def test_idx_directory_source(tmp_path):
    d = data.load_dataset("mnist")
    directory = write_mnist_dir(str(tmp_path / "idx"), d.train_images[:300, ..., 0], d.train_labels[:300],
                                d.eval_images[:50, ..., 0], d.eval_labels[:50], compress=True)
    loaded = data.load_dataset(f"idx:{directory}")
    assert (loaded.num_train, loaded.num_eval) == (300, 50)
    np.testing.assert_array_equal(loaded.train_images, d.train_images[:300])


def test_idx_directory_missing_file(tmp_path):
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"")
    with pytest.raises(UserError, match="has no train-labels-idx1-ubyte"):
        data.load_dataset(f"idx:{tmp_path}")
    with pytest.raises(UserError, match="no such directory"):
        data.load_dataset(f"idx:{tmp_path}/absent")


def test_unknown_source_lists_valid_ones():
    with pytest.raises(UserError, match=r"use one of: mnist \(bundled digits\), synthetic, idx:DIR"):
        data.load_dataset("cifar")


def test_synthetic_source_shapes():
    d = data.load_dataset("synthetic")
    assert d.train_images.shape == (data.SYNTHETIC_TRAIN, 28, 28, 1) and d.eval_labels.max() <= 9


def test_tfds_source_with_mock_data():
    with tfds_testing.mock_data(num_examples=96):
        d = data.load_dataset("tfds:mnist")
    assert d.name == "tfds:mnist"
    assert d.train_images.shape == (96, 28, 28, 1) and d.train_images.dtype == np.uint8
    assert d.num_eval == 96 and set(np.unique(d.train_labels)) <= set(range(10))


def test_tfds_without_download_says_what_is_missing(tmp_path):
    with pytest.raises(UserError) as e:
        data.load_dataset("tfds:mnist", data_dir=str(tmp_path))
    assert f"no prepared copy in {tmp_path}" in str(e.value) and "--download is off" in str(e.value)


def test_tfds_non_mnist_shape_is_rejected():
    with tfds_testing.mock_data(num_examples=8):
        with pytest.raises(UserError, match=r"has images of shape \(32, 32, 3\)"):
            data.load_dataset("tfds:cifar10")
