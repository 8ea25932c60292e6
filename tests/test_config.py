"""tfdist.mnist.config: validation messages name the bad value and a fix."""

import pytest

from tfdist.mnist.config import TrainConfig
from tfdist.errors import UserError


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"global_batch_size": 128, "per_replica_batch_size": 32}, "were both set"),
        ({"precision": "float8"}, "--precision='float8' is not a valid choice; use one of: auto, float32"),
        ({"lr_scaling": "cubic"}, "use one of: none, linear, sqrt"),
        ({"num_cpu_replicas": 0}, "--num_cpu_replicas=0 is below 1"),
        ({"global_batch_size": 0}, "--global_batch_size=0 must be a positive integer"),
        ({"grad_accum_steps": 0}, "--grad_accum_steps=0 must be a positive integer"),
        ({"learning_rate": -1.0}, "--learning_rate=-1.0 must be positive"),
        ({"checkpoint_every_steps": -5}, "--checkpoint_every_steps=-5 must be 0"),
    ],
)
def test_validate_rejects(changes, expected):
    with pytest.raises(UserError) as e:
        TrainConfig(**changes).validate()
    assert expected in str(e.value)


def test_defaults_are_valid_and_round_trip():
    config = TrainConfig().validate()
    assert TrainConfig.from_dict(config.to_dict()) == config


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(UserError, match=r"Unknown configuration field\(s\) \['epoch'\]"):
        TrainConfig.from_dict({"epoch": 3})
