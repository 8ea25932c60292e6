"""Run under horovodrun by tests/test_horovod.py: what each rank reads and starts from.

Each rank builds the Horovod backend, seeds its model with its own rank (so the
initial weights differ before the broadcast), broadcasts, and reads one epoch
of the real bundled digits through the same dataset_fn the training loop uses.
It writes the image hashes it read and the weights fingerprints to OUT_DIR.
"""

import hashlib
import json
import os
import sys

import numpy as np

from tfdist.mnist import data, model
from tfdist.distribute import horovod_support
from tfdist.training import inputs


def main(out_dir: str) -> None:
    backend = horovod_support.build_backend(op="average", compression="none")
    rank = backend.worker_index
    net = model.build_cnn(seed=rank)
    before = model.fingerprint([np.asarray(w) for w in net.weights])
    backend.broadcast_initial_state(net.variables)
    after = model.fingerprint([np.asarray(w) for w in net.weights])
    digits = data.load_dataset("mnist")
    steps = digits.num_train // 128
    dataset = backend.distribute_dataset(inputs.train_arrays_fn(
        inputs.Arrays(digits.train_images, digits.train_labels), per_replica_batch=64, steps_per_epoch=steps, seed=0,
        total_steps=steps))
    batches = list(dataset.take(steps))
    hashes = [hashlib.sha1(image.tobytes()).hexdigest() for images, _ in batches for image in images.numpy()]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "size": backend.num_replicas, "before": before, "after": after,
                   "batch_sizes": sorted({int(images.shape[0]) for images, _ in batches}), "hashes": hashes}, f)


if __name__ == "__main__":
    main(sys.argv[1])
