"""The program of scripts/benchmark.py's ps_embedding rows: an embedding model trained under parameter servers.

Run as every task of a parameter-server job (tfdist-launch starts it as the
chief, the workers and the ps tasks; the workers and ps tasks serve inside
`tfdist.make_strategy` and exit). The chief builds

  ids (one int32 id per example) -> embedding (ROWS x DIM) -> Flatten -> Dense(1)

with either `tfdist.layers.ShardedEmbedding` (one row shard per ps task) or
`keras.layers.Embedding` (one whole-table variable on one ps), compiles it with
SGD or Adagrad and mean squared error, and trains it with `tfdist.fit` on
random ids in [0, ROWS) and random targets, ``--steps_per_epoch`` steps of
``--batch`` examples per epoch. It writes WORKDIR/metrics.json with the
seconds of each epoch's training (on_epoch_begin to on_epoch_end; nothing is
evaluated), as tfdist-train's metrics.json does, so the benchmark takes
throughput over epochs 2..N (the first pays for tracing and start-up).

  tfdist-launch --num_workers=2 --num_ps=2 -- python scripts/ps_embedding.py --workdir=W --layer=sharded \
      --rows=1000000 --optimizer=adagrad
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfdist  # noqa: E402
from keras_fit_baseline import EpochTimer  # noqa: E402  (scripts/ is on sys.path: run as a file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="metrics.json goes here (the chief's).")
    parser.add_argument("--layer", choices=("sharded", "keras"), required=True,
                        help="sharded: tfdist.layers.ShardedEmbedding; keras: keras.layers.Embedding.")
    parser.add_argument("--rows", type=int, default=1_000_000, help="Rows of the embedding table.")
    parser.add_argument("--dim", type=int, default=64, help="Columns of the embedding table.")
    parser.add_argument("--optimizer", choices=("sgd", "adagrad"), default="sgd")
    parser.add_argument("--learning_rate", type=float, default=0.05)
    parser.add_argument("--batch", type=int, default=1024, help="Global batch size.")
    parser.add_argument("--steps_per_epoch", type=int, default=50)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps_per_execution", type=int, default=10)
    args = parser.parse_args()

    strategy = tfdist.make_strategy("parameter_server", precision="float32")  # Workers and ps tasks exit here.
    import tensorflow as tf

    from tfdist.layers import ShardedEmbedding

    examples = args.steps_per_epoch * args.batch
    rng = np.random.default_rng(0)
    ids = rng.integers(0, args.rows, size=(examples, 1)).astype("int32")
    targets = rng.normal(size=(examples, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        embedding = (ShardedEmbedding(args.rows, args.dim, name="table") if args.layer == "sharded"
                     else keras.layers.Embedding(args.rows, args.dim, name="table"))
        model = keras.Sequential([keras.Input((1,), dtype="int32"), embedding, keras.layers.Flatten(),
                                  keras.layers.Dense(1)])
        optimizer = (keras.optimizers.SGD(args.learning_rate) if args.optimizer == "sgd"
                     else keras.optimizers.Adagrad(args.learning_rate))
        model.compile(optimizer, "mse")
    timer = EpochTimer()
    start = time.perf_counter()
    tfdist.fit(model, ids, targets, batch_size=args.batch, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch,
               steps_per_execution=args.steps_per_execution, callbacks=[timer], verbose=0,
               export=())
    fit_seconds = time.perf_counter() - start
    cluster = json.loads(os.environ.get("TF_CONFIG", "{}")).get("cluster", {})
    shards = getattr(embedding, "shards", None) or [embedding.embeddings]
    metrics = {
        "epoch_train_seconds": timer.seconds,
        "steps_per_epoch": args.steps_per_epoch,
        "global_batch_size": args.batch,
        "steps_per_execution": args.steps_per_execution,
        "eval_accuracy": None,  # Random targets: nothing to evaluate.
        "last_train_loss": timer.last_loss,
        "fit_seconds": round(fit_seconds, 3),
        "layer": args.layer,
        "table_rows": args.rows,
        "table_dim": args.dim,
        "optimizer": args.optimizer,
        "table_devices": [getattr(s, "value", s).device for s in shards],
        "num_ps": len(cluster.get("ps", [])),
        "num_workers": len(cluster.get("worker", [])),
        "dataset": f"random ids (1 per example) in 0..{args.rows - 1}",
        "precision": "float32",
        "tensorflow_version": tf.__version__,
        "keras_version": keras.__version__,
    }
    os.makedirs(args.workdir, exist_ok=True)
    with open(os.path.join(args.workdir, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)


if __name__ == "__main__":
    main()
