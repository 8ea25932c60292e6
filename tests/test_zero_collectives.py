"""tfdist.training.zero.collectives and tf_private: reduce-scatter (all-to-all plus a local sum) and the
all-gather of equal parts, against the all-reduce, on 2 and 4 in-process replicas; and TensorFlow's private
names where tfdist expects them."""

import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.distribute import strategies
from tfdist.training.zero import collectives, tf_private


def test_tensorflow_keeps_the_private_names_sharding_uses():
    """Fails on a TensorFlow that moved the collective launchers or collective_ops' all-to-all/all-gather
    (sharding would then fall back to the all-reduce, at twice the traffic)."""
    assert tf_private.available() == []
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32")
    assert len(tf_private.launchers(strategy)) == 2
    assert tf_private.launchers(tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32",
                                                     all_reduce="reduce_to_one")) is None


def run(strategy, fn):
    """fn(backend) on every replica in one compiled step: its results as (one array a replica) per output."""
    backend = strategies.backend_of(strategy)

    @tf.function
    def step():
        return backend.run(lambda: fn(backend), ())
    return backend, [[np.asarray(t) for t in strategy.experimental_local_results(output)] for output in step()]


# One process's collective groups take their sizes from the first strategy that used them (a 4-replica
# collective MirroredStrategy after a 2-replica one aborts: "joining a group with size4, but that group has
# size 2"), so in-process collectives run on 2 replicas, as the rest of the suite's; 4 run reduce_to_one.
@pytest.mark.parametrize("replicas,all_reduce,way", [(2, "auto", "collective"), (2, "reduce_to_one", "all_reduce"),
                                                     (4, "reduce_to_one", "all_reduce")])
def test_reduce_scatter_and_all_gather_equal_the_all_reduce(replicas, all_reduce, way):
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=replicas, precision="float32",
                                    all_reduce=all_reduce)
    values = np.random.default_rng(0).normal(size=(replicas, 12 * replicas)).astype("float32")

    def each(backend):
        r = backend.replica_index()
        mine = tf.constant(values[r])
        return (collectives.reduce_scatter(backend, mine, r, "rs"),
                collectives.all_gather(backend, mine[:12] * 2.0, r, "ag"),
                collectives.all_sum(backend, [mine[:3]], r, "sum")[0])
    backend, (scattered, gathered, summed) = run(strategy, each)
    assert collectives.path(backend) == way
    total = values.sum(0)
    for r in range(replicas):  # Replica r gets the sum's r-th slice, and every replica's part in order.
        np.testing.assert_allclose(scattered[r], total[r * 12:(r + 1) * 12], rtol=1e-6)
        np.testing.assert_array_equal(gathered[r], np.concatenate([values[k][:12] * 2.0 for k in range(replicas)]))
        np.testing.assert_allclose(summed[r], total[:3], rtol=1e-6)
    if replicas == 2:  # Two addends: the same sum in either order, bit for bit.
        np.testing.assert_array_equal(np.concatenate(scattered), total)


def test_collectives_of_a_new_strategy_do_not_reuse_an_earlier_ones_instance_keys():
    """Each new strategy's launchers count instance keys from 100 again, and the process remembers a key's
    op type and shape: tfdist's own collectives draw keys no strategy resets (an all-to-all at an earlier
    all-reduce's key aborted: "Collective instance 100 expected type 0 ... but got type 4")."""
    for size in (4, 6):
        strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32")

        def each(backend):
            r = backend.replica_index()
            flat = tf.fill([size], float(r + 1))
            return (collectives.reduce_scatter(backend, flat, r, "rs"),
                    collectives.all_gather(backend, flat, r, "ag"))
        _, (scattered, gathered) = run(strategy, each)
        np.testing.assert_array_equal(scattered[1], [3.0] * (size // 2))
        np.testing.assert_array_equal(gathered[0], [1.0] * size + [2.0] * size)
