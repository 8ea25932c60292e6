"""tfdist.distribute.tasks: a script's own files on a multi-task job (the job itself: test_fitting, test_horovod)."""

import types

import tfdist
from tfdist.distribute import strategies


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
