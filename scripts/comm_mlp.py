"""A communication-bound job: a few-million-parameter MLP on synthetic data, trained by tfdist or tf_keras.

The benchmark's ``comm_*`` rows run it under ``tfdist-launch --link_rate=R``,
where moving one step's gradients takes about as long as computing them. Both
frameworks build the same model (``--width`` units in ``--layers`` hidden
layers, float32 weights, seed 0), read the same synthetic examples (a fixed
random set, whole global batches, repeated) and train with plain SGD at the
same rate and steps per execution; only the framework differs:

  --framework=tfdist    ``tfdist.fit`` under ``tfdist.make_strategy("auto")`` (MWMS, parameter servers or one
                        device, from TF_CONFIG), with --all_reduce_dtype and --grad_accum_steps.
  --framework=tf_keras  ``model.fit`` of tf_keras (TF_USE_LEGACY_KERAS=1) under the strategy TF_CONFIG names, as
                        TensorFlow's multi-worker and parameter-server tutorials write it.

The chief (worker 0 without a chief task) prints one line ``BENCH {json}``
with per-epoch training seconds (Keras' epoch callbacks; evaluation is not run),
the steps per epoch, the global batch, the gradient bytes per step, the bytes
the job's loopback carried per step (epochs 2..N; all tasks' traffic) and the
final loss. The other tasks print nothing of it.

With --measure_bound (tfdist under MWMS or one device), after fit the same
processes time the engine's own step parts as scripts/overlap_probe.py does (a
plain-TensorFlow copy of the MLP, tf.function steps under the same strategy,
median of --bound_steps): t_forward, t_backward (forward + backward + SGD update
less forward), t_comm (one all-reduce of the gradient-shaped tensors through the
strategy) and bound_ms = t_forward + max(t_backward, t_comm), added to the BENCH line.

  tfdist-launch --num_workers=2 --link_rate=1gbit -- python scripts/comm_mlp.py --framework=tfdist --measure_bound
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchlib import programs  # noqa: E402  (scripts/ is on sys.path: run as a file)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--framework", choices=("tfdist", "tf_keras"), default="tfdist")
    parser.add_argument("--features", type=int, default=512, help="Input width.")
    parser.add_argument("--width", type=int, default=1024, help="Units per hidden layer.")
    parser.add_argument("--layers", type=int, default=3, help="Hidden layers.")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch", type=int, default=256, help="Global batch.")
    parser.add_argument("--examples", type=int, default=4096, help="Synthetic examples (a multiple of --batch).")
    parser.add_argument("--steps_per_epoch", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps_per_execution", type=int, default=1)
    parser.add_argument("--learning_rate", type=float, default=0.01)
    parser.add_argument("--all_reduce_dtype", default="float32", help="tfdist only.")
    parser.add_argument("--all_reduce_pack_mb", type=float, default=None,
                        help="tfdist only (default: tfdist's packs; 0: one pack).")
    parser.add_argument("--grad_accum_steps", type=int, default=1, help="tfdist only.")
    parser.add_argument("--measure_bound", action="store_true",
                        help="tfdist only: after fit, time t_forward, t_backward and t_comm (scripts/overlap_probe.py) "
                             "and report bound_ms = t_forward + max(t_backward, t_comm).")
    parser.add_argument("--bound_steps", type=int, default=10, help="Timed steps per part of --measure_bound.")
    parser.add_argument("--bound_warmup", type=int, default=2, help="Untimed steps per part first.")
    return parser.parse_args(argv)


def synthetic(args):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.examples, args.features), dtype=np.float32)
    y = rng.integers(0, args.classes, size=(args.examples,)).astype(np.int32)
    return x, y


def build(keras, args):
    """The MLP, in whichever Keras is passed (Keras 3 or tf_keras), seeded alike."""
    init = keras.initializers.GlorotUniform
    model = keras.Sequential([keras.Input((args.features,))]
                             + [keras.layers.Dense(args.width, activation="relu", kernel_initializer=init(seed=i))
                                for i in range(args.layers)]
                             + [keras.layers.Dense(args.classes, kernel_initializer=init(seed=args.layers))])
    return model


def loopback_bytes() -> int:
    """Bytes sent on this network namespace's loopback so far (tfdist-launch gives each job its own)."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, counters = line.partition(":")
                if name.strip() == "lo":
                    return int(counters.split()[8])  # Transmit bytes.
    except OSError:
        pass
    return 0


def timer_class(keras):
    class LinkTimer(programs.epoch_timer(keras)):
        """Also the bytes the loopback carried each epoch."""

        def on_train_begin(self, logs=None):
            super().on_train_begin(logs)
            self.bytes = []

        def on_epoch_begin(self, epoch, logs=None):
            super().on_epoch_begin(epoch, logs)
            self.start_bytes = loopback_bytes()

        def on_epoch_end(self, epoch, logs=None):
            super().on_epoch_end(epoch, logs)
            self.bytes.append(loopback_bytes() - self.start_bytes)

    return LinkTimer


def report(args, timer, model, framework_version: str, bound: Optional[dict] = None) -> None:
    if not programs.reports_here():
        return
    steady = timer.bytes[1:] or timer.bytes  # Epochs 2..N.
    params = int(sum(math.prod(int(d) for d in w.shape) for w in model.trainable_weights))
    print("BENCH " + json.dumps({
        "epoch_train_seconds": timer.seconds, "steps_per_epoch": args.steps_per_epoch,
        "global_batch_size": args.batch, "parameters": params, "gradient_bytes": params * 4,
        "framework": args.framework, "framework_version": framework_version,
        "all_reduce_dtype": args.all_reduce_dtype, "grad_accum_steps": args.grad_accum_steps,
        "steps_per_execution": args.steps_per_execution,
        "link_bytes_per_step": round(sum(steady) / (len(steady) * args.steps_per_epoch)),
        "loss": None if timer.last_loss is None else float(timer.last_loss), **(bound or {})}), flush=True)


def measure_bound(strategy, args) -> dict:
    """t_forward, t_backward, t_comm and bound_ms on this job's workers, as scripts/overlap_probe.py times them."""
    import overlap_probe  # Beside this script (scripts/ is on sys.path).

    measured = overlap_probe.measure(strategy, args.features, args.width, args.layers, args.classes, args.batch,
                                     steps=args.bound_steps, warmup=args.bound_warmup,
                                     learning_rate=args.learning_rate)
    return {**{k: measured[k] for k in ("t_forward_ms", "t_backward_ms", "t_comm_ms", "bound_ms")},
            "bound_steps": args.bound_steps, "bound_modes": measured["modes"]}


def run_tfdist(args) -> None:
    import keras
    import tensorflow as tf

    import tfdist

    strategy = tfdist.make_strategy("auto", precision="float32", all_reduce_dtype=args.all_reduce_dtype,
                                    all_reduce_pack_mb=args.all_reduce_pack_mb)
    parameter_servers = isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)
    if args.measure_bound and parameter_servers:
        raise SystemExit("--measure_bound needs MWMS or one device, not parameter servers.")
    with strategy.scope():
        model = build(keras, args)
        model.compile(optimizer=keras.optimizers.SGD(args.learning_rate),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=args.steps_per_execution)
    x, y = synthetic(args)
    timer = timer_class(keras)()
    tfdist.fit(model, x, y, batch_size=args.batch, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch,
               shuffle=parameter_servers,  # In order; parameter servers' workers read in an order of their own.
               grad_accum_steps=args.grad_accum_steps, callbacks=[timer], verbose=0, export=())
    bound = measure_bound(strategy, args) if args.measure_bound else None
    report(args, timer, model, "tfdist, keras " + keras.__version__, bound)


def run_tf_keras(args) -> None:
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import tensorflow as tf
    import tf_keras as keras

    config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    task = config.get("task", {})
    if "ps" in config.get("cluster", {}):
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        if task["type"] in ("worker", "ps"):  # As TensorFlow's parameter-server tutorial: these only serve.
            server = tf.distribute.Server(resolver.cluster_spec(), job_name=task["type"], task_index=task["index"],
                                          protocol="grpc", start=True)
            server.join()
            return
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    elif config:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        strategy = tf.distribute.get_strategy()
    x, y = synthetic(args)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(args.batch, drop_remainder=True)
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        options = tf.data.Options()  # Each worker reads its half of every global batch.
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
        dataset = dataset.with_options(options)
    with strategy.scope():
        model = build(keras, args)
        model.compile(optimizer=keras.optimizers.SGD(args.learning_rate),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=args.steps_per_execution)
    timer = timer_class(keras)()
    model.fit(dataset, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch, callbacks=[timer], verbose=0)
    report(args, timer, model, "tf_keras " + keras.__version__)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.examples % args.batch:
        raise SystemExit(f"--examples={args.examples} must be a multiple of --batch={args.batch}.")
    if args.measure_bound and args.framework != "tfdist":
        raise SystemExit("--measure_bound is for --framework=tfdist.")
    (run_tfdist if args.framework == "tfdist" else run_tf_keras)(args)


if __name__ == "__main__":
    main()
