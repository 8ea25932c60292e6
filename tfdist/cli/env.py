"""tfdist-env: the facts a bug report needs, in one report.

Prints versions (Python, TensorFlow, Keras, tensorflow-datasets, absl,
Horovod), the CUDA, cuDNN and NCCL versions TensorFlow was built with, the
NVIDIA driver version where visible, devices with GPU compute capability,
whether Horovod is importable and built with TensorFlow and which
controllers/ops it has, whether the `ssh` client that `tfdist-launch --hosts`
needs is present, the parsed TF_CONFIG if any, and the precision
``--precision=auto`` would choose.
Add ``--json`` for machine-readable output.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import re
import shutil
import subprocess
import sys
from typing import Any, Optional

from tfdist.cli import common

common.quiet_tensorflow()

from absl import app, flags  # noqa: E402

flags.DEFINE_boolean("json", False, "Print the report as JSON.")
FLAGS = flags.FLAGS


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def gpu_build_info() -> dict[str, Any]:
    """What TensorFlow was built with (`tf.sysconfig.get_build_info()`), plus the NCCL it finds.

    Pip builds of TensorFlow do not record NCCL in their build info; they load
    the NCCL of the `nvidia-nccl-cu12` package (the `and-cuda` extra), so that
    package's version is reported when the build info has none.
    """
    import tensorflow as tf

    info = dict(tf.sysconfig.get_build_info())
    nccl = info.get("nccl_version")
    if not nccl:
        package = _version("nvidia-nccl-cu12")
        nccl = f"{package} (nvidia-nccl-cu12)" if package != "not installed" else None
    return {
        "is_cuda_build": bool(info.get("is_cuda_build")),
        "is_rocm_build": bool(info.get("is_rocm_build")),
        "cuda_version": info.get("cuda_version"),
        "cudnn_version": info.get("cudnn_version"),
        "nccl_version": nccl,
        "cuda_compute_capabilities": info.get("cuda_compute_capabilities"),
    }


def gpu_driver_version(proc_file: str = "/proc/driver/nvidia/version") -> Optional[str]:
    """The NVIDIA driver version from the kernel module's /proc file, else `nvidia-smi`; None if neither."""
    try:
        with open(proc_file) as f:
            match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", f.read())
        if match:
            return match.group(1)
    except OSError:
        pass
    if shutil.which("nvidia-smi"):
        try:
            result = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=20)
            versions = sorted(set(result.stdout.split()))
            if result.returncode == 0 and versions:
                return ", ".join(versions)
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None


def ssh_client() -> dict[str, Any]:
    """Whether the OpenSSH client (`tfdist-launch --hosts` starts tasks with it) is on PATH, and its version."""
    path = shutil.which("ssh")
    if path is None:
        return {"present": False, "path": None, "version": None}
    try:
        result = subprocess.run([path, "-V"], capture_output=True, text=True, timeout=10)
        version = (result.stderr or result.stdout).strip().splitlines()[0] if (result.stderr or result.stdout) else None
    except (OSError, subprocess.TimeoutExpired):
        version = None
    return {"present": True, "path": path, "version": version}


def horovod_report() -> dict[str, Any]:
    """Whether Horovod imports and what it was built with (never raises)."""
    from tfdist.distribute import horovod_support

    return horovod_support.report()


def collect() -> dict[str, Any]:
    import tensorflow as tf

    from tfdist.distribute import cluster, strategies
    from tfdist import precision
    from tfdist.errors import UserError

    gpus = tf.config.list_physical_devices("GPU")
    devices = []
    for device in tf.config.list_physical_devices():
        entry = {"name": device.name, "type": device.device_type}
        if device.device_type == "GPU":
            details = tf.config.experimental.get_device_details(device)
            entry["compute_capability"] = ".".join(map(str, details.get("compute_capability", ()))) or None
            entry["device_name"] = details.get("device_name")
        devices.append(entry)
    try:
        info = cluster.resolve()
        tf_config: Any = None if info.task_type is None else {
            "source": info.source, "cluster": {k: list(v) for k, v in info.cluster.items()},
            "task": {"type": info.task_type, "index": info.task_index},
            "num_workers": info.num_workers, "num_ps": info.num_ps, "is_chief": info.is_chief,
        }
    except UserError as e:
        tf_config = {"error": str(e)}
    kind = "gpu" if gpus else "cpu"
    choice = precision.choose("auto", device_kind=kind, gpu_compute_capability=strategies.gpu_compute_capability())
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {p: _version(p) for p in ("tfdist", "tensorflow", "keras", "tensorflow-datasets",
                                               "absl-py", "tensorboard", "numpy", "horovod")},
        "tensorflow_built_with_cuda": tf.test.is_built_with_cuda(),
        "gpu_build": gpu_build_info(),
        "gpu_driver_version": gpu_driver_version(),
        "ssh_client": ssh_client(),
        "devices": devices,
        "cpu_bf16_flags": precision.cpu_bf16_flags(),
        "precision_auto": {"policy": choice.policy, "reason": choice.reason},
        "horovod": horovod_report(),
        "tf_config": tf_config,
        "strategies": strategies.strategy_names(),
    }


def format_report(report: dict[str, Any]) -> str:
    lines = ["tfdist environment report", f"python: {report['python']} ({report['platform']})"]
    for package, version in report["packages"].items():
        lines.append(f"{package}: {version}")
    lines.append(f"tensorflow built with CUDA: {report['tensorflow_built_with_cuda']}")
    build = report["gpu_build"]
    if build["is_cuda_build"]:
        lines.append(f"  built with CUDA {build['cuda_version']}, cuDNN {build['cudnn_version']}, "
                     f"NCCL {build['nccl_version'] or 'not in the build info (nvidia-nccl-cu12 not installed)'}")
    lines.append(f"NVIDIA driver: {report['gpu_driver_version'] or 'not visible (no /proc/driver/nvidia, no nvidia-smi)'}")
    lines.append("devices:")
    for device in report["devices"]:
        extra = f" compute capability {device['compute_capability']} ({device.get('device_name')})" \
            if device["type"] == "GPU" else ""
        lines.append(f"  {device['name']}{extra}")
    lines.append(f"CPU bfloat16 flags: {', '.join(report['cpu_bf16_flags']) or 'none'}")
    auto = report["precision_auto"]
    lines.append(f"--precision=auto would choose: {auto['policy']} ({auto['reason']})")
    hvd = report["horovod"]
    lines.append(f"horovod: {hvd['status']}")
    for key in ("tensorflow_built", "gloo_built", "mpi_built", "nccl_built", "error"):
        if key in hvd:
            lines.append(f"  {key}: {hvd[key]}")
    tf_config = report["tf_config"]
    lines.append(f"TF_CONFIG: {json.dumps(tf_config) if tf_config else 'not set'}")
    ssh = report["ssh_client"]
    lines.append(f"ssh client (for tfdist-launch --hosts): {ssh['version'] + ' at ' + ssh['path'] if ssh['present'] else 'not found'}")
    lines.append(f"strategies: {', '.join(report['strategies'])}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    del argv
    report = collect()
    print(json.dumps(report, indent=2) if FLAGS.json else format_report(report))
    return 0


def run() -> None:
    app.run(lambda argv: common.run_reporting_user_errors("tfdist-env", lambda: main(argv)))


if __name__ == "__main__":
    run()
