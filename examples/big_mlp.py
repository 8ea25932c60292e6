"""A model whose training state does not fit a worker's memory budget, trained by sharding it (ZeRO).

A 4 x 4096 MLP: 50.4M float32 weights (201 MB); Adam's two moments are 403 MB more. Every data-parallel replica
holds all of it; with ``ZERO_STAGE=2`` each of N replicas holds 1/N of the moments, with ``ZERO_STAGE=3`` also
1/N of the weights, each layer's gathered just before its call (docs/sharding.md).

  tfdist-launch --num_workers=2 -- python examples/big_mlp.py                  # ZERO_STAGE=2 (the default)
  ZERO_STAGE=0 tfdist-launch --num_workers=2 -- python examples/big_mlp.py     # unsharded, for comparison

  CPU_REPLICAS=4 WIDTH=3072 python examples/big_mlp.py                       # one process of 4 CPU replicas
  ZERO_STAGE=3 CPU_REPLICAS=4 DEPTH=16 WIDTH=2048 python examples/big_mlp.py  # 63.0M weights, stage 3

Prints the process's peak resident memory. tests/test_examples.py runs the 4-replica process under memory
limits: at stage 2 under one between the two runs' peaks (unsharded it is killed, sharded it trains), and at
stage 3 under one where a model of half the weights is killed unsharded and the 16-layer model above trains.
Stage 3 gathers a layer at a time, so it saves the most when no one layer is a large part of the model.
"""

import os
import resource

import keras
import numpy as np

import tfdist

WIDTH, DEPTH = int(os.environ.get("WIDTH", "4096")), int(os.environ.get("DEPTH", "4"))
STEPS = int(os.environ.get("STEPS", "6"))
keras.utils.set_random_seed(0)
zero_stage = int(os.environ.get("ZERO_STAGE", "2"))

rng = np.random.default_rng(0)
x_train = rng.normal(size=(16 * STEPS, WIDTH)).astype("float32")
y_train = rng.integers(0, 10, size=16 * STEPS)

# CPU_REPLICAS=4: one process of 4 CPU replicas, standing in for one host's 4 GPUs (each holds its own copy).
replicas = int(os.environ.get("CPU_REPLICAS", "0"))
strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=replicas) if replicas else tfdist.make_strategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((WIDTH,))] +
                             [keras.layers.Dense(WIDTH, activation="relu") for _ in range(DEPTH - 1)] +
                             [keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

history = tfdist.fit(model, x_train, y_train, batch_size=16, epochs=1, verbose=0, zero_stage=zero_stage)
peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(f"zero_stage={zero_stage} params={model.count_params()} loss={history.history['loss'][-1]:.4f} "
      f"peak_rss_mb={peak_mb:.0f}", flush=True)
