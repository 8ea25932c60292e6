"""tfdist.training.plan: what the workers' plans differ in, as the plan check (checks.check_agreement) says it,
and plan fields that come out the same in every process whatever order its data arrives in."""

import json
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.errors import UserError
from tfdist.training import checks, plan as plan_lib, sources


def a_plan(**changes) -> plan_lib.LoopPlan:
    fields = dict(global_batch=128, per_replica_batch=64, micro_batch=64, grad_accum_steps=1, steps_per_epoch=78,
                  epochs=2, total_steps=156, steps_per_execution=10, seed=0,
                  extra=(("data", "dataset"), ("num_train", 10000)), num_replicas=2)
    fields.update(changes)
    return plan_lib.LoopPlan(**fields)


class TwoTasks:
    """Worker 0's backend in a two-worker job whose worker 1 resolved `peer`: each gather returns worker 0's
    row and the row worker 1 sends at the same call of `check_agreement`."""

    single_controller, worker_index, num_workers = False, 0, 2

    def __init__(self, peer: plan_lib.LoopPlan, precision: str = "float32"):
        import hashlib

        text = json.dumps({"worker": 1, "fields": peer.resume_fields()}, sort_keys=True).encode()
        self.peer_rows = iter([
            np.array([1, 0, peer.digest(), int(hashlib.sha256(precision.encode()).hexdigest()[:7], 16), 0]),
            np.array([len(text)]),
            np.frombuffer(text, np.uint8).astype(np.int64)])

    def gather_from_tasks(self, row: np.ndarray) -> np.ndarray:
        peer = next(self.peer_rows)
        if peer.shape != row.shape:  # The texts, padded to the longer one.
            padded = np.zeros(max(len(peer), len(row)), np.int64)
            padded[:len(peer)] = peer
            peer = padded
        return np.stack([row, peer])


def test_the_plan_check_names_each_field_that_differs_and_each_tasks_value():
    """The error used to say only that the plans differ, not in what: a user could not tell a flag from data."""
    mine = a_plan()
    peer = a_plan(global_batch=64, per_replica_batch=32, steps_per_epoch=157,
                  extra=(("data", "dataset"), ("num_train", 10048), ("shuffle", False)))
    with pytest.raises(UserError) as raised:
        checks.check_agreement(TwoTasks(peer), mine, 0, "float32", 0.0)
    message = str(raised.value)
    assert message.startswith("The workers disagree about the plan (batch sizes, steps, seed, learning rate, "
                              "dataset): tasks worker 0, worker 1 resolved different values: global_batch (worker 0: "
                              "128, worker 1: 64); num_train (worker 0: 10000, worker 1: 10048); shuffle (worker 0: "
                              "absent, worker 1: false); steps_per_epoch (worker 0: 78, worker 1: 157). "), message
    assert "epochs" not in message and "seed" not in message.split("values:")[1], message


def test_plan_differences_shows_long_values_cut_and_leaves_agreeing_fields_out():
    plans = {0: {"epoch_steps": list(range(100)), "seed": 1}, 1: {"epoch_steps": list(range(101)), "seed": 1}}
    text = plan_lib.plan_differences(plans)
    assert text.startswith("epoch_steps (worker 0: [0, 1, 2,") and text.count("...") == 2 and "seed" not in text


def batches_in_order(short_first: bool) -> tf.data.Dataset:
    """240 examples in batches of 32 and one of 16, the short one last or first: the orders two processes may meet
    them in when a dataset is shuffled after batching (each its own unseeded shuffle, or a parallel map that is not
    deterministic)."""
    x = np.arange(240 * 3, dtype="float32").reshape(240, 3)
    batched = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(32)
    return batched.skip(7).concatenate(batched.take(7)) if short_first else batched


def test_the_global_batch_of_a_dataset_is_the_same_whatever_batch_comes_first():
    """Without batch_size=, the global batch was the first batch's size: 16 in a process whose order starts with
    the short batch, 32 in another, so two workers of one job resolved different plans."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    backend = types.SimpleNamespace(sharded_input=True, num_replicas=1)
    firsts, resolved = set(), set()
    for short_first in (False, True):
        dataset = batches_in_order(short_first)
        firsts.add(int(next(iter(dataset))[0].shape[0]))
        source = sources.adapt(model, backend, dataset, None, None, None, None)
        resolved.add((int(source.batch_size), source.num_examples))
    assert firsts == {16, 32}  # The orders differ, as two processes' may.
    assert resolved == {(32, 240)}
