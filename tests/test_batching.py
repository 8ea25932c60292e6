"""tfdist.mnist.batching: batch split, accumulation, learning-rate scaling and warm-up."""

import math

import numpy as np
import pytest

from tfdist.mnist import batching
from tfdist.mnist.config import TrainConfig
from tfdist.errors import UserError


def plan(replicas=1, **changes):
    return batching.plan(TrainConfig(**changes), num_replicas=replicas, num_train=8000, num_eval=2000)


def test_global_batch_is_split_across_replicas():
    p = plan(4, global_batch_size=256)
    assert (p.global_batch, p.per_replica_batch, p.micro_batch) == (256, 64, 64)
    assert p.steps_per_epoch == 8000 // 256 and p.total_steps == 5 * (8000 // 256)


def test_per_replica_batch_with_accumulation():
    p = plan(2, per_replica_batch_size=16, grad_accum_steps=4)
    assert (p.global_batch, p.per_replica_batch, p.micro_batch) == (128, 64, 16)


def test_accumulation_divides_the_global_batch():
    p = plan(2, global_batch_size=128, grad_accum_steps=2)
    assert (p.per_replica_batch, p.micro_batch) == (64, 32)


def test_non_divisible_global_batch_names_valid_sizes():
    with pytest.raises(UserError) as e:
        plan(3, global_batch_size=128)
    assert "does not divide evenly across 3 replica(s)" in str(e.value)
    assert "e.g. 126 or 129" in str(e.value)


def test_batch_smaller_than_replicas():
    with pytest.raises(UserError, match="smaller than the number of replicas"):
        plan(4, global_batch_size=2)


def test_batch_larger_than_dataset():
    with pytest.raises(UserError, match="larger than the training set"):
        plan(1, global_batch_size=16000)


@pytest.mark.parametrize("scaling, factor", [("none", 1.0), ("linear", 4.0), ("sqrt", 2.0)])
def test_lr_scaling(scaling, factor):
    p = plan(4, learning_rate=0.01, lr_scaling=scaling)
    assert math.isclose(p.learning_rate, 0.01 * factor)


def test_max_steps_caps_total():
    assert plan(1, max_steps=7).total_steps == 7


def test_warmup_then_cosine_schedule():
    p = plan(1, warmup_epochs=1.0)
    assert p.warmup_steps == p.steps_per_epoch and p.decay_steps == 5 * p.steps_per_epoch
    assert plan(1, lr_schedule="constant").decay_steps == 0
    constant = batching.WarmupCosine(0.1, 4)
    np.testing.assert_allclose([float(constant(s)) for s in range(6)], [0.025, 0.05, 0.075, 0.1, 0.1, 0.1], rtol=1e-6)
    cosine = batching.WarmupCosine(0.1, 2, 10)
    values = [float(cosine(s)) for s in range(11)]
    np.testing.assert_allclose(values[:2], [0.05, 0.1], rtol=1e-6)
    assert values[6] == pytest.approx(0.05, rel=1e-5)  # Halfway through the decay.
    assert values[10] == pytest.approx(0.0, abs=1e-7) and all(a >= b for a, b in zip(values[1:], values[2:]))
    assert float(batching.WarmupCosine(0.1, 0)(0)) == pytest.approx(0.1)


def test_eval_steps_cover_every_example():
    p = plan(3, global_batch_size=129)
    assert p.eval_steps * p.eval_per_replica_batch * 3 >= 2000
    assert (p.eval_steps - 1) * p.eval_per_replica_batch * 3 < 2000
