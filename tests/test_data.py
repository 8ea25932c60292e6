"""tfdist.mnist.data: the data sources (bundled digits, IDX directories, tensorflow-datasets, synthetic)."""

import hashlib
import logging
import os

import numpy as np
import pytest
import tensorflow as tf

from tests import tiny_digits
from tests.idx_files import write_mnist_dir
from tfdist.mnist import data
from tfdist.errors import UserError


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


def tfds_digits(data_dir):
    return data.load_dataset("tfds:tiny_digits", data_dir=data_dir)


def test_tfds_train_split_is_streamed_and_test_split_read(tiny_digits_dir, monkeypatch):
    read = []
    monkeypatch.setattr(data, "_to_arrays", lambda ds, real=data._to_arrays: read.append(real(ds)) or read[-1])
    d = tfds_digits(tiny_digits_dir)
    assert [len(labels) for _, labels in read] == [tiny_digits.NUM_TEST]  # Only the test split is materialised.
    assert d.name == "tfds:tiny_digits" and d.train_images is None and d.train_labels is None
    assert (d.num_train, d.num_eval, d.train_stream.num_files) == (2000, 500, 4)  # num_train from the metadata.
    assert d.eval_images.dtype == np.uint8 and d.eval_labels.dtype == np.int32
    _, _, test_images, test_labels = tiny_digits.digits()
    assert sorted(zip(image_keys(d.eval_images), d.eval_labels)) == sorted(zip(image_keys(test_images), test_labels))


def stream_pass(d, global_batch, seed=0, ctx=None):
    """One pass of a pipeline's dataset: (image keys, labels, batch shapes)."""
    keys, labels, shapes = [], [], set()
    for images, batch_labels in d.train_stream.dataset_fn(global_batch, seed=seed)(ctx or tf.distribute.InputContext()):
        shapes.add((tuple(images.shape), images.dtype, tuple(batch_labels.shape), batch_labels.dtype))
        keys += image_keys(images.numpy())
        labels += batch_labels.numpy().tolist()
    return keys, labels, shapes


def test_tfds_stream_yields_shuffled_per_replica_batches_of_the_train_split(tiny_digits_dir):
    d = tfds_digits(tiny_digits_dir)
    train_images, train_labels, _, _ = tiny_digits.digits()
    label_of = dict(zip(image_keys(train_images), train_labels.tolist()))
    keys, labels, shapes = stream_pass(d, 64)
    assert shapes == {((64, 28, 28, 1), tf.uint8, (64,), tf.int32)}
    assert len(keys) == 31 * 64 and len(set(keys)) == len(keys)  # Whole batches, each example once a pass.
    assert [label_of[k] for k in keys] == labels
    # Two replicas of one pipeline split each global batch in order: the same examples per step.
    halves, _, half_shapes = stream_pass(d, 64, ctx=tf.distribute.InputContext(1, 0, 2))
    assert halves == keys and half_shapes == {((32, 28, 28, 1), tf.uint8, (32,), tf.int32)}
    assert stream_pass(d, 64)[0] == keys  # The seed fixes the order (resume relies on it) ...
    assert stream_pass(d, 64, seed=1)[0] != keys  # ... and another seed changes it.


@pytest.mark.parametrize("pipelines", [2, 3])
def test_tfds_stream_gives_each_input_pipeline_its_own_share(tiny_digits_dir, pipelines, caplog):
    """4 files: 2 pipelines read 2 files each (tfds shards by input context); 3 read a third of the examples each."""
    d = tfds_digits(tiny_digits_dir)
    with caplog.at_level(logging.INFO):
        shares = [stream_pass(d, pipelines, ctx=tf.distribute.InputContext(pipelines, i, pipelines))[0]
                  for i in range(pipelines)]
    assert ("streamed from 2 of its 4 file(s)" if pipelines == 2 else "1/3 of its examples (4 file(s))") in caplog.text
    assert sum(len(s) for s in shares) == 2000 and len(set().union(*shares)) == 2000  # Disjoint, complete.
    assert max(len(s) for s in shares) - min(len(s) for s in shares) <= 1


def test_tfds_without_download_says_what_is_missing(tmp_path):
    with pytest.raises(UserError) as e:
        data.load_dataset("tfds:mnist", data_dir=str(tmp_path))
    assert f"no prepared copy in {tmp_path}" in str(e.value) and "--download is off" in str(e.value)


@pytest.mark.parametrize("name, message", [("cifar10", r"has images of shape \(32, 32, 3\)"),
                                           ("emnist", "has 62 classes; tfdist's model has 10 outputs")])
def test_tfds_non_mnist_features_are_rejected_from_metadata(tmp_path, name, message):
    """Checked from the builder's features: nothing is prepared in tmp_path, nothing is downloaded."""
    with pytest.raises(UserError, match=message):
        data.load_dataset(f"tfds:{name}", data_dir=str(tmp_path))


def test_tfds_unknown_name():
    with pytest.raises(UserError, match="tensorflow-datasets does not know it"):
        data.load_dataset("tfds:no_such_dataset_here")
