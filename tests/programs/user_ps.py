"""A parameter-server program that builds its own tf.distribute strategy and servers, and trains through tfdist.

Run on every task by `tfdist-launch --num_workers=1 --num_ps=1` (chief, worker, ps). The worker and the ps
run the program's own `tf.distribute.Server` until the chief has finished (as a tf.distribute program does;
tfdist is not called there); the chief builds `tf.distribute.experimental.ParameterServerStrategy` itself,
builds the model under it and trains it with `tfdist.fit` (tfdist takes the model's strategy). The one weight
gets gradient 1 a step (loss = the prediction on x = 1), so plain SGD leaves it at -lr * steps whatever
worker ran which step. Writes OUT/chief0.npz: the weight, the steps, what tfdist.evaluate returned and what
tfdist.train_on_batch raised.
"""

import os
import socket
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import tfdist

STEPS, BATCH, LR = 24, 8, 0.01


def serve(resolver) -> None:
    """The program's own server, until the chief has come and gone."""
    spec = resolver.cluster_spec()
    # One inter-op thread more than the workers' concurrent calls (a 2-core machine deadlocks without it).
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=len(spec.as_dict()["worker"]) + 2)
    tf.distribute.Server(spec, job_name=resolver.task_type, task_index=resolver.task_id, protocol="grpc",
                         config=config, start=True)
    host, port = spec.as_dict()["chief"][0].rsplit(":", 1)
    seen, deadline = False, time.time() + 240
    while time.time() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            seen = True
        except OSError:
            if seen:
                break
        time.sleep(0.5)
    os._exit(0)


def main() -> None:
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type in ("worker", "ps"):
        serve(resolver)
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    with strategy.scope():
        inputs = keras.Input((1,))
        model = keras.Model(inputs, keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")(inputs))
        model.compile(optimizer=keras.optimizers.SGD(LR), loss=lambda y, p: tf.reduce_mean(p, axis=-1))
    x = np.ones((STEPS * BATCH, 1), "float32")
    history = tfdist.fit(model, x, np.zeros_like(x), batch_size=BATCH, verbose=0)
    evaluated = tfdist.evaluate(model, x[:10], np.zeros((10, 1), "float32"), verbose=0)
    try:
        tfdist.train_on_batch(model, x[:BATCH], np.zeros((BATCH, 1), "float32"))
        refused = ""
    except tfdist.UserError as e:
        refused = str(e)
    np.savez(os.path.join(sys.argv[1], "chief0.npz"), kernel=model.get_weights()[0],
             iterations=int(model.optimizer.iterations), evaluated=evaluated, refused=refused,
             loss=history.history["loss"][-1])
    print(f"[chief] trained {STEPS} steps under the program's own ParameterServerStrategy", flush=True)


if __name__ == "__main__":
    main()
