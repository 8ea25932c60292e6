"""Read-only cluster resolution: who is in the job and which task this is.

`resolve()` reads TF_CONFIG (or, when absent, a SLURM step's environment) and
returns one typed, validated `ClusterInfo`. It never writes the environment;
building strategies from it is `tfdist.distribute.strategies`' job. TensorFlow's own
resolver accepts much nonsense silently, so everything is checked here and
every error names the offending field and value and shows a valid one. `failure_line`
is what a failed task of a job prints (`tfdist.distribute.barriers`) and the launcher
reads back (`failure_in`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Optional

from tfdist.errors import UserError

ROLES = ("chief", "worker", "ps", "evaluator")
_EXAMPLE = (
    'A valid TF_CONFIG looks like {"cluster": {"worker": ["host1:2222", '
    '"host2:2222"]}, "task": {"type": "worker", "index": 0}}.'
)


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """The cluster and this process's task in it."""

    source: str  # "TF_CONFIG", "SLURM" or "local".
    cluster: Mapping[str, tuple[str, ...]]
    task_type: Optional[str]
    task_index: int

    @property
    def num_workers(self) -> int:
        """Tasks that train: chief plus workers."""
        return len(self.cluster.get("chief", ())) + len(self.cluster.get("worker", ()))

    @property
    def num_ps(self) -> int:
        return len(self.cluster.get("ps", ()))

    @property
    def is_multi_worker(self) -> bool:
        return self.num_workers > 1 or self.num_ps > 0

    @property
    def is_chief(self) -> bool:
        if self.task_type is None:
            return True
        if "chief" in self.cluster:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_index == 0

    @property
    def worker_index(self) -> int:
        """Index among the training tasks, the chief first."""
        if self.task_type == "worker" and "chief" in self.cluster:
            return self.task_index + 1
        return self.task_index if self.task_type in ("chief", "worker") else 0

    @property
    def label(self) -> str:
        return "local" if self.task_type is None else f"{self.task_type}:{self.task_index}"


LOCAL = ClusterInfo("local", {}, None, 0)


def resolve(environ: Optional[Mapping[str, str]] = None) -> ClusterInfo:
    """Reads the cluster from `environ` (default: os.environ). Read-only.

    TF_CONFIG wins; without it, a SLURM job step of more than one task
    (``srun``) is read with TensorFlow's SlurmClusterResolver; otherwise the
    process is alone.
    """
    environ = os.environ if environ is None else environ
    raw = environ.get("TF_CONFIG", "").strip()
    if raw:
        return parse_tf_config(raw)
    if _slurm_tasks(environ) > 1:
        return from_slurm(environ)
    return LOCAL


def _slurm_tasks(environ: Mapping[str, str]) -> int:
    if "SLURM_PROCID" not in environ or "SLURM_STEP_ID" not in environ:
        return 0
    value = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or "0"
    return int(value) if value.isdigit() else 0


def from_slurm(environ: Mapping[str, str]) -> ClusterInfo:
    """Resolves a SLURM step (one worker per task) with TensorFlow's resolver.

    Ports are TFDIST_SLURM_PORT_BASE (default 8888) plus the task's slot on its
    node. The resolver is asked not to touch CUDA_VISIBLE_DEVICES: resolution
    stays read-only.
    """
    import contextlib
    from unittest import mock

    import tensorflow as tf

    port_base = environ.get("TFDIST_SLURM_PORT_BASE", "8888")
    if not port_base.isdigit():
        raise UserError(f"TFDIST_SLURM_PORT_BASE={port_base!r} must be a port number, e.g. 8888.")
    try:
        # The resolver reads os.environ itself; show it the mapping we were given.
        same = environ is os.environ
        with contextlib.nullcontext() if same else mock.patch.dict(os.environ, dict(environ), clear=True):
            # GPU numbers only feed its CUDA_VISIBLE_DEVICES assignment, which is switched off.
            resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(port_base=int(port_base), gpus_per_node=1024, gpus_per_task=1,
                                            auto_set_gpu=False)
            spec = resolver.cluster_spec().as_dict()
            task_type, task_id = resolver.get_task_info()
    except (RuntimeError, ValueError, KeyError) as e:
        raise UserError(
            f"This looks like a SLURM job step (SLURM_PROCID={environ.get('SLURM_PROCID')}), but its "
            f"environment could not be resolved into a cluster: {e}. Launch with srun, or set TF_CONFIG."
        ) from None
    cluster = {role: tuple(addresses) for role, addresses in spec.items()}
    return ClusterInfo("SLURM", cluster, task_type, int(task_id))


def tf_cluster_resolver(info: ClusterInfo) -> Optional[Any]:
    """A TensorFlow cluster resolver for `info` (None when alone or from TF_CONFIG).

    TF_CONFIG clusters are left to TensorFlow's own TFConfigClusterResolver,
    which reads the same variable this module validated.
    """
    if info.source != "SLURM":
        return None
    import tensorflow as tf

    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({k: list(v) for k, v in info.cluster.items()}),
        task_type=info.task_type, task_id=info.task_index, rpc_layer="grpc",
    )


def _fail(message: str) -> UserError:
    return UserError(f"TF_CONFIG is invalid: {message} {_EXAMPLE}")


def parse_tf_config(raw: str) -> ClusterInfo:
    """Parses and validates a TF_CONFIG string."""
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        shown = raw if len(raw) <= 60 else raw[:57] + "..."
        raise _fail(f"it is not JSON ({e.msg} at position {e.pos} of {shown!r}).") from None
    if not isinstance(config, dict):
        raise _fail(f"it must be a JSON object, not {type(config).__name__}.")
    if "cluster" not in config:
        raise _fail('it has no "cluster" field.')
    if "task" not in config:
        raise _fail('it has no "task" field (which task of the cluster is this process?).')
    cluster_raw, task = config["cluster"], config["task"]
    if not isinstance(cluster_raw, dict) or not cluster_raw:
        raise _fail(f'"cluster" must be a non-empty object of role -> address list, not {cluster_raw!r}.')
    cluster: dict[str, tuple[str, ...]] = {}
    seen: dict[str, str] = {}
    for role, addresses in cluster_raw.items():
        if role not in ROLES:
            raise _fail(f'cluster role "{role}" is unknown; roles are {", ".join(ROLES)}.')
        if not isinstance(addresses, list) or not addresses:
            raise _fail(f'cluster.{role} must be a non-empty list of "host:port" strings, not {addresses!r}.')
        for i, address in enumerate(addresses):
            where = f"cluster.{role}[{i}]"
            _check_address(where, address)
            if address in seen:
                raise _fail(f'{where} = "{address}" duplicates {seen[address]}; every task needs its own address.')
            seen[address] = where
        cluster[role] = tuple(addresses)
    if len(cluster.get("chief", ())) > 1:
        raise _fail(f"cluster.chief lists {len(cluster['chief'])} addresses; a cluster has at most one chief.")
    if not isinstance(task, dict):
        raise _fail(f'"task" must be an object like {{"type": "worker", "index": 0}}, not {task!r}.')
    task_type = task.get("type")
    if task_type not in ROLES:
        raise _fail(f'task.type = {task_type!r} is not a role; use one of {", ".join(ROLES)}.')
    index = task.get("index", 0)
    if isinstance(index, str) and index.isdigit():
        index = int(index)
    if not isinstance(index, int) or isinstance(index, bool):
        raise _fail(f"task.index = {index!r} must be an integer.")
    if task_type != "evaluator" or task_type in cluster:
        if task_type not in cluster:
            raise _fail(
                f'task.type = "{task_type}" is not in the cluster, which has '
                f'{", ".join(sorted(cluster))}.'
            )
        size = len(cluster[task_type])
        if not 0 <= index < size:
            raise _fail(f"task.index = {index} is out of range: cluster.{task_type} has {size} task(s), so use 0 to {size - 1}.")
    elif index != 0:
        raise _fail(f"task.index = {index} for the evaluator must be 0.")
    if "worker" not in cluster and "chief" not in cluster:
        raise _fail("the cluster has no chief and no worker, so no task would train.")
    return ClusterInfo("TF_CONFIG", cluster, task_type, index)


def _check_address(where: str, address: object) -> None:
    if not isinstance(address, str) or not address:
        raise _fail(f'{where} = {address!r} must be a "host:port" string.')
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise _fail(f'{where} = "{address}" has no port; write it as "host:port", e.g. "{address}:2222".')
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise _fail(f'{where} = "{address}" has port "{port}", which is not a number from 1 to 65535.')


# A task of a synchronous job that fails with an uncaught error tells the other tasks (tfdist.distribute.barriers)
# and prints this line; tfdist-launch reads it to name the task whose error ended the job (`failure_in`).
_FAILED = "failed, and told the other tasks of the job: "


def failure_line(label: str, error: str) -> str:
    """What a failing task prints once its error has reached the other tasks."""
    return f"tfdist: {label} {_FAILED}{error}"


def failure_in(line: str) -> Optional[str]:
    """The error a `failure_line` names ("Type: message"), or None for any other line."""
    head, found, error = line.partition(" " + _FAILED)
    return error.strip() if found and head.startswith("tfdist: ") and " " not in head[len("tfdist: "):] else None
