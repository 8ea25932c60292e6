"""tfdist.distribute.tasks: a script's own files on a multi-task job (the job itself: test_fitting, test_horovod;
a program's own MultiWorkerMirroredStrategy: tests/programs/user_strategy.py in test_adopting)."""

import json
import types

import pytest

import tfdist
from tfdist.distribute import adopting, strategies


def test_the_chief_keeps_the_path_and_other_tasks_name_theirs(monkeypatch):
    tfdist.make_strategy("default", precision="float32")
    assert tfdist.is_chief()
    assert tfdist.task_path("out/initial_weights.weights.h5") == "out/initial_weights.weights.h5"
    task = types.SimpleNamespace(is_chief=False, worker_index=3)
    monkeypatch.setattr(strategies, "current_backend", lambda: task)
    assert not tfdist.is_chief()
    assert tfdist.task_path("out/initial_weights.weights.h5") == "out/initial_weights.task3.weights.h5"
    assert tfdist.task_path("model.keras") == "model.task3.keras"
    assert tfdist.task_path("/tmp/log") == "/tmp/log.task3"


def _no_backend(monkeypatch, tf_config):
    """A process of a TF_CONFIG job whose program built its own strategy: no tfdist backend exists yet."""
    monkeypatch.setattr(strategies, "_CURRENT", [])
    monkeypatch.setattr(adopting, "_ADOPTED", [])
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))


CLUSTER = {"worker": ["localhost:1", "localhost:2"]}


@pytest.mark.parametrize("task, chief, path", [
    ({"type": "worker", "index": 0}, True, "w.weights.h5"),
    ({"type": "worker", "index": 1}, False, "w.task1.weights.h5"),
])
def test_a_tf_config_task_answers_before_any_tfdist_backend(monkeypatch, task, chief, path):
    """Under TF_CONFIG, before tfdist has seen the program's own MultiWorkerMirroredStrategy, the task TF_CONFIG
    names answers: worker 0 is the chief where the cluster has no chief task (these calls used to build
    --strategy=default's backend, which refuses a TF_CONFIG cluster)."""
    _no_backend(monkeypatch, {"cluster": CLUSTER, "task": task})
    assert tfdist.is_chief() is chief
    assert tfdist.task_path("w.weights.h5") == path
    assert strategies._CURRENT == []  # Nothing built to answer.


def test_a_chief_task_is_the_chief_and_worker_0_is_not(monkeypatch):
    cluster = {"chief": ["localhost:3"], **CLUSTER}
    _no_backend(monkeypatch, {"cluster": cluster, "task": {"type": "chief", "index": 0}})
    assert tfdist.is_chief() and tfdist.task_path("w.h5") == "w.h5"
    _no_backend(monkeypatch, {"cluster": cluster, "task": {"type": "worker", "index": 0}})
    assert not tfdist.is_chief() and tfdist.task_path("w.h5") == "w.task1.h5"


def test_the_adopted_strategys_task_answers(monkeypatch):
    """After tfdist trained under the program's own strategy (no make_strategy), its backend answers."""
    _no_backend(monkeypatch, {"cluster": CLUSTER, "task": {"type": "worker", "index": 0}})
    monkeypatch.setattr(adopting, "_ADOPTED", [types.SimpleNamespace(is_chief=False, worker_index=1,
                                                                      strategy=object())])
    assert not tfdist.is_chief()
    assert tfdist.task_path("model.keras") == "model.task1.keras"
