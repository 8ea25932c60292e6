"""tfdist.distribute.strategies: the registry, option checks and the backends it builds."""

import json

import pytest
import tensorflow as tf

from tfdist.distribute import strategies
from tfdist.mnist.config import TrainConfig
from tfdist.errors import UserError


def build(**changes):
    return strategies.build_backend(TrainConfig(**changes))


def test_registry_names():
    assert strategies.strategy_names() == [
        "auto", "default", "one_device", "mirrored", "multi_worker_mirrored", "parameter_server", "tpu", "horovod",
    ]


def test_unknown_strategy_lists_valid_ones():
    with pytest.raises(UserError) as e:
        build(strategy="mirror")
    assert str(e.value) == (
        "--strategy='mirror' is not a known strategy; valid strategies are: auto, default, one_device, "
        "mirrored, multi_worker_mirrored, parameter_server, tpu, horovod."
    )


def test_default_and_one_device():
    default = build(strategy="default")
    assert (default.num_replicas, default.num_workers, default.is_chief) == (1, 1, True)
    assert isinstance(build(strategy="one_device").strategy, tf.distribute.OneDeviceStrategy)


def test_mirrored_on_cpu_replicas():
    backend = build(strategy="mirrored", num_cpu_replicas=3)
    assert isinstance(backend.strategy, tf.distribute.MirroredStrategy)
    assert backend.num_replicas == 3 and backend.device_kind == "cpu"


def test_auto_picks_mirrored_for_cpu_replicas_and_default_otherwise():
    assert build(strategy="auto", num_cpu_replicas=2).name == "mirrored"
    assert build(strategy="auto").name == "default"


@pytest.mark.parametrize("changes, expected", [
    ({"num_cpu_replicas": 2, "all_reduce": "ring"},
     "--strategy=auto chose mirrored (--num_cpu_replicas=2 was given), and then: --all_reduce='ring' is not valid "
     "with --strategy=mirrored; use one of: auto, nccl, hierarchical_copy, reduce_to_one."),
    ({"all_reduce": "ring"},
     "--strategy=auto chose default (no TPU, GPU or cluster was found), and then: --all_reduce=ring has no effect "
     "with --strategy=default;"),
    ({"ps_shards": 2}, "--strategy=auto chose default (no TPU, GPU or cluster was found), and then: --ps_shards "
                       "applies to --strategy=parameter_server, not --strategy=default."),
    ({"hvd_op": "adasum"}, "and then: --hvd_compression/--hvd_op are Horovod options but --strategy=default"),
])
def test_auto_runs_the_option_checks_of_the_strategy_it_chose(monkeypatch, changes, expected):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(UserError) as e:
        build(strategy="auto", **changes)
    assert expected in str(e.value)


def test_single_process_multi_worker_mirrored(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    backend = build(strategy="multi_worker_mirrored")
    assert isinstance(backend.strategy, tf.distribute.MultiWorkerMirroredStrategy)
    assert (backend.num_workers, backend.num_replicas, backend.is_chief) == (1, 1, True)
    # Unless told a pack size, tfdist chooses each step's (`backend.pack_bytes`).
    assert backend.auto_pack and backend.strategy.extended._communication_options.bytes_per_pack == 0


@pytest.mark.parametrize("pack_mb, expected", [(None, 0), (0.0, 0), (0.5, 2**19)])
def test_multi_worker_mirrored_packs_as_asked(monkeypatch, pack_mb, expected):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    seen = []

    def strategy(cluster_resolver, communication_options):
        seen.append(communication_options.bytes_per_pack)
        raise RuntimeError("stop here")  # The options are all this test reads; one MWMS per process.

    monkeypatch.setattr(tf.distribute, "MultiWorkerMirroredStrategy", strategy)
    with pytest.raises(RuntimeError, match="stop here"):
        build(strategy="multi_worker_mirrored", all_reduce_pack_mb=pack_mb)
    assert seen == [expected]


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"strategy": "mirrored", "all_reduce": "ring"},
         "--all_reduce='ring' is not valid with --strategy=mirrored; use one of: auto, nccl, hierarchical_copy, "
         "reduce_to_one."),
        ({"strategy": "multi_worker_mirrored", "all_reduce": "hierarchical_copy"},
         "use one of: auto, ring, nccl."),
        ({"strategy": "default", "all_reduce": "nccl"}, "--all_reduce=nccl has no effect with --strategy=default"),
        ({"strategy": "mirrored", "all_reduce": "nccl", "num_cpu_replicas": 2}, "--all_reduce=nccl needs GPUs"),
        ({"strategy": "one_device", "num_cpu_replicas": 2}, "--num_cpu_replicas applies to --strategy=mirrored"),
        ({"strategy": "mirrored", "num_gpus": 2}, "--num_gpus=2 but this machine has no GPU"),
        ({"strategy": "mirrored", "num_cpu_replicas": 64}, "cannot be re-split"),
        ({"strategy": "default", "tpu": "local"}, "--tpu only applies to --strategy=tpu"),
        ({"strategy": "mirrored", "hvd_compression": "fp16"}, "Horovod options but --strategy=mirrored"),
    ],
)
def test_bad_options(changes, expected):
    with pytest.raises(UserError) as e:
        build(**changes)
    assert expected in str(e.value)


def test_single_process_strategy_refuses_a_cluster(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": {"worker": ["localhost:1", "localhost:2"]}, "task": {"type": "worker", "index": 0}}))
    with pytest.raises(UserError, match="trains in one process, but TF_CONFIG describes a cluster of 2 worker"):
        build(strategy="mirrored")


def test_multi_worker_refuses_ps_tasks(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": {"worker": ["localhost:1"], "ps": ["localhost:2"]}, "task": {"type": "worker", "index": 0}}))
    with pytest.raises(UserError, match="TF_CONFIG has a ps task, but --strategy=multi_worker_mirrored"):
        build(strategy="multi_worker_mirrored")


def test_malformed_tf_config_with_multi_worker(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "{cluster: oops")
    with pytest.raises(UserError, match="TF_CONFIG is invalid: it is not JSON"):
        build(strategy="multi_worker_mirrored")


@pytest.mark.parametrize("megabytes, expected_mb", [(0.04, 4), (10.5, 4), (100, 12.5), (1000, 64)])
def test_a_steps_packs_are_an_eighth_of_its_gradients_within_4_to_64_mb(megabytes, expected_mb):
    from tfdist.distribute.backend import pack_bytes

    floats = int(megabytes * 2**20 / 4)
    grads = [tf.TensorSpec([floats // 2], tf.float32), tf.TensorSpec([floats - floats // 2], tf.float32)]
    seen = []
    tf.function(lambda *g: seen.append(pack_bytes(g))).get_concrete_function(*grads)
    assert seen == [int(expected_mb * 2**20)]  # The bytes of dtype and shape; 100 MB: 12.5 MB packs.
