"""Kubeflow TFJob manifests for `tfdist-launch --print_tfjob`.

`tfjob_manifest` describes a job as a `kubeflow.org/v1` TFJob: a `Worker`
replica spec for N workers, and for parameter-server jobs a `Chief` (1) and a
`PS` (M) spec, each running the same container command with
`restartPolicy: OnFailure`. The Kubeflow training operator sets TF_CONFIG in
every pod itself. Every pod mounts one shared volume (a PersistentVolumeClaim
placeholder to fill in) where `--workdir` lives, so a restarted pod resumes
from the chief's checkpoints. `to_yaml` writes the manifest as YAML without a
YAML library: every string is emitted JSON-quoted, which YAML reads verbatim.
"""

from __future__ import annotations

import json
import posixpath
import re
from typing import Any, Sequence

from tfdist.errors import UserError

DEFAULT_MOUNT = "/shared"
TFJOB_PORT = 2222  # The port the training operator puts in TF_CONFIG (its default, named tfjob-port).


def _workdir(command: Sequence[str]) -> str | None:
    for i, arg in enumerate(command):
        if arg.startswith("--workdir="):
            return arg.split("=", 1)[1]
        if arg == "--workdir" and i + 1 < len(command):
            return command[i + 1]
    return None


def tfjob_manifest(*, name: str, image: str, command: Sequence[str], num_workers: int, num_ps: int = 0,
                   claim_name: str = "tfdist-shared") -> dict[str, Any]:
    """The TFJob as a dict (see `to_yaml`). Parameter-server jobs (num_ps > 0) get a Chief replica."""
    if not image:
        raise UserError("--print_tfjob needs --image=IMAGE: the container image every replica runs (one with "
                        "tfdist installed), e.g. --image=registry.example.com/tfdist:0.1.0.")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name):
        raise UserError(f"--job_name={name!r} is not a valid Kubernetes name: lower-case letters, digits and '-', "
                        "starting and ending with a letter or digit, at most 63 characters (e.g. tfdist-mnist).")
    if not command:
        raise UserError("--print_tfjob needs the container command after --, e.g. tfdist-launch --print_tfjob "
                        "--image=IMAGE --num_workers=2 -- tfdist-train --strategy=multi_worker_mirrored "
                        "--workdir=/shared/runs/mw.")
    workdir = _workdir(command)
    mount = posixpath.dirname(workdir.rstrip("/")) if workdir and workdir.startswith("/") else DEFAULT_MOUNT
    mount = mount if mount not in ("", "/") else DEFAULT_MOUNT

    def replica(count: int) -> dict[str, Any]:
        return {
            "replicas": count,
            "restartPolicy": "OnFailure",
            "template": {"spec": {
                "containers": [{
                    "name": "tensorflow",  # The training operator finds the TensorFlow container by this name.
                    "image": image,
                    "command": list(command),
                    "ports": [{"name": "tfjob-port", "containerPort": TFJOB_PORT}],
                    "volumeMounts": [{"name": "workdir", "mountPath": mount}],
                }],
                "volumes": [{"name": "workdir", "persistentVolumeClaim": {"claimName": claim_name}}],
            }},
        }

    specs: dict[str, Any] = {}
    if num_ps:
        specs["Chief"] = replica(1)
    specs["Worker"] = replica(num_workers)
    if num_ps:
        specs["PS"] = replica(num_ps)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "TFJob",
        "metadata": {"name": name},
        "spec": {"runPolicy": {"cleanPodPolicy": "Running"}, "tfReplicaSpecs": specs},
    }


def to_yaml(value: Any, indent: int = 0) -> str:
    """Block-style YAML for dicts, lists and scalars (strings JSON-quoted)."""
    pad = " " * indent
    lines = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                lines.append(f"{pad}{key}:")
                lines.append(to_yaml(item, indent + 2))
            else:
                lines.append(f"{pad}{key}: {json.dumps(item)}")
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, (dict, list)) and item:
                body = to_yaml(item, indent + 2)
                lines.append(f"{pad}- {body[indent + 2:]}")
            else:
                lines.append(f"{pad}- {json.dumps(item)}")
    else:
        lines.append(f"{pad}{json.dumps(value)}")
    return "\n".join(lines)


def manifest_text(manifest: dict[str, Any], claim_name: str = "tfdist-shared") -> str:
    """The manifest as a YAML document with a header saying what to fill in and how to apply it."""
    header = (f"# Kubeflow TFJob written by tfdist-launch --print_tfjob. The training operator sets TF_CONFIG.\n"
              f"# Placeholder: the PersistentVolumeClaim {claim_name!r} (ReadWriteMany) holds --workdir for\n"
              f"# every replica; create it first. Then: kubectl apply -f tfjob.yaml\n")
    return header + to_yaml(manifest) + "\n"
