"""tfdist.distribute.cluster: TF_CONFIG parsing; every malformed input gets a message naming the field."""

import json

import pytest

from tfdist.distribute import cluster
from tfdist.errors import UserError


def parse(value):
    return cluster.parse_tf_config(value if isinstance(value, str) else json.dumps(value))


W2 = {"worker": ["localhost:2001", "localhost:2002"]}


def test_valid_worker_cluster():
    info = parse({"cluster": W2, "task": {"type": "worker", "index": 1}})
    assert (info.num_workers, info.is_chief, info.worker_index, info.label) == (2, False, 1, "worker:1")
    assert parse({"cluster": W2, "task": {"type": "worker", "index": 0}}).is_chief


def test_chief_and_ps_cluster():
    info = parse({"cluster": {"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4"]},
                  "task": {"type": "worker", "index": 0}})
    assert (info.num_workers, info.num_ps, info.is_chief, info.worker_index) == (3, 1, False, 1)


def test_resolve_without_tf_config_is_local():
    assert cluster.resolve({}) is cluster.LOCAL and not cluster.LOCAL.is_multi_worker


@pytest.mark.parametrize(
    "value, expected",
    [
        ("{not json", "it is not JSON (Expecting property name enclosed in double quotes at position 1"),
        ([1, 2], "it must be a JSON object, not list"),
        ({"task": {"type": "worker", "index": 0}}, 'it has no "cluster" field'),
        ({"cluster": W2}, 'it has no "task" field'),
        ({"cluster": {"worker": []}, "task": {"type": "worker", "index": 0}},
         'cluster.worker must be a non-empty list of "host:port" strings, not []'),
        ({"cluster": {"trainer": ["h:1"]}, "task": {"type": "trainer", "index": 0}},
         'cluster role "trainer" is unknown; roles are chief, worker, ps, evaluator'),
        ({"cluster": W2, "task": {"type": "chief", "index": 0}},
         'task.type = "chief" is not in the cluster, which has worker'),
        ({"cluster": W2, "task": {"type": "gpu", "index": 0}}, "task.type = 'gpu' is not a role"),
        ({"cluster": W2, "task": {"type": "worker", "index": 2}},
         "task.index = 2 is out of range: cluster.worker has 2 task(s), so use 0 to 1"),
        ({"cluster": W2, "task": {"type": "worker", "index": -1}}, "task.index = -1 is out of range"),
        ({"cluster": W2, "task": {"type": "worker", "index": "one"}}, "task.index = 'one' must be an integer"),
        ({"cluster": {"worker": ["localhost:2001", "localhost:2001"]}, "task": {"type": "worker", "index": 0}},
         'cluster.worker[1] = "localhost:2001" duplicates cluster.worker[0]'),
        ({"cluster": {"worker": ["localhost"]}, "task": {"type": "worker", "index": 0}},
         'cluster.worker[0] = "localhost" has no port; write it as "host:port", e.g. "localhost:2222"'),
        ({"cluster": {"worker": ["localhost:70000"]}, "task": {"type": "worker", "index": 0}},
         'cluster.worker[0] = "localhost:70000" has port "70000", which is not a number from 1 to 65535'),
        ({"cluster": {"worker": ["localhost:0"]}, "task": {"type": "worker", "index": 0}},
         'has port "0", which is not a number from 1 to 65535'),
        ({"cluster": {"worker": ["h:1"], "chief": ["h:2", "h:3"]}, "task": {"type": "worker", "index": 0}},
         "cluster.chief lists 2 addresses; a cluster has at most one chief"),
        ({"cluster": {"ps": ["h:1"]}, "task": {"type": "ps", "index": 0}}, "the cluster has no chief and no worker"),
        ({"cluster": W2, "task": "worker"}, '"task" must be an object'),
    ],
)
def test_malformed_tf_config(value, expected):
    with pytest.raises(UserError) as e:
        parse(value)
    message = str(e.value)
    assert message.startswith("TF_CONFIG is invalid: ")
    assert expected in message
    assert "A valid TF_CONFIG looks like" in message


SLURM_STEP = {
    "SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_STEP_NODELIST": "node[07-08]", "SLURM_STEP_TASKS_PER_NODE": "2,1",
}


def test_slurm_step_becomes_a_worker_cluster():
    info = cluster.resolve(SLURM_STEP)
    assert info.source == "SLURM"
    assert info.cluster == {"worker": ("node07:8888", "node07:8889", "node08:8888")}
    assert (info.task_type, info.task_index, info.num_workers, info.is_chief) == ("worker", 1, 3, False)


def test_slurm_port_base_and_tf_config_precedence():
    info = cluster.resolve({**SLURM_STEP, "TFDIST_SLURM_PORT_BASE": "12000"})
    assert info.cluster["worker"][0] == "node07:12000"
    tf_config = json.dumps({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}})
    assert cluster.resolve({**SLURM_STEP, "TF_CONFIG": tf_config}).source == "TF_CONFIG"


def test_single_task_slurm_step_is_local():
    assert cluster.resolve({**SLURM_STEP, "SLURM_STEP_NUM_TASKS": "1"}) is cluster.LOCAL


def test_inconsistent_slurm_step_is_a_clear_error():
    with pytest.raises(UserError, match="This looks like a SLURM job step .* could not be resolved"):
        cluster.resolve({**SLURM_STEP, "SLURM_STEP_TASKS_PER_NODE": "1"})
