"""A real tensorflow-datasets dataset for tests: `tiny_digits`, prepared on disk from the bundled digits.

`prepare(data_dir)` runs tfds' own `download_and_prepare` (a generator builder:
nothing is downloaded) and writes ``data_dir/tiny_digits/1.0.0`` with a train
split of the first `NUM_TRAIN` bundled training digits and a test split of the
first `NUM_TEST` held-out ones, each in `NUM_FILES` TFRecord files. The builder
class is not registered with tfds, so `tfds.builder("tiny_digits", data_dir=...)`
finds the prepared files the way it finds any dataset whose code is not
importable (tfds' read-only builder), in this process and in a `tfdist-train`
subprocess alike.
"""

from __future__ import annotations

import numpy as np
import tensorflow_datasets as tfds

from tfdist.mnist import data

NAME = "tiny_digits"
NUM_TRAIN, NUM_TEST, NUM_FILES = 2000, 500, 4


def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The examples the splits hold: (train images, train labels, test images, test labels)."""
    bundled = data.load_dataset("mnist")
    return (bundled.train_images[:NUM_TRAIN], bundled.train_labels[:NUM_TRAIN],
            bundled.eval_images[:NUM_TEST], bundled.eval_labels[:NUM_TEST])


class TinyDigits(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    VERSION = tfds.core.Version("1.0.0")
    # No checksums file beside the code. (tfds' own lookup of the code's path needs the
    # importlib_resources package for a module inside a package; this environment lacks it.)
    code_path = None

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self, supervised_keys=("image", "label"),
            features=tfds.features.FeaturesDict({"image": tfds.features.Image(shape=(28, 28, 1)),
                                                 "label": tfds.features.ClassLabel(num_classes=10)}))

    def _split_generators(self, dl_manager):
        train_images, train_labels, test_images, test_labels = digits()
        return {"train": self._generate_examples(train_images, train_labels),
                "test": self._generate_examples(test_images, test_labels)}

    def _generate_examples(self, images, labels):
        for i, (image, label) in enumerate(zip(images, labels)):
            yield i, {"image": image, "label": int(label)}


def prepare(data_dir: str, num_files: int = NUM_FILES) -> str:
    """Prepares tiny_digits under `data_dir` (no network) and returns `data_dir`."""
    TinyDigits(data_dir=data_dir).download_and_prepare(
        download_config=tfds.download.DownloadConfig(num_shards=num_files))
    return data_dir
