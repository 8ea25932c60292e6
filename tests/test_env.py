"""tfdist.cli.env: the diagnostics report."""

import json
import os
import shutil

import pytest
import tensorflow as tf

from tests.conftest import run_module
from tfdist.distribute import horovod_support, strategies
from tfdist import precision


def report(env=None, *args):
    result = run_module("tfdist.cli.env", ["--json", *args], env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_report_has_versions_devices_and_precision():
    data = report()
    assert data["packages"]["tensorflow"] == tf.__version__
    assert data["packages"]["keras"].startswith("3.")
    assert any(d["type"] == "CPU" for d in data["devices"])
    # What --precision=auto would pick on this machine, computed here the way training does.
    gpus = tf.config.list_physical_devices("GPU")
    assert data["cpu_bf16_flags"] == precision.cpu_bf16_flags()
    if not gpus:
        assert data["precision_auto"]["policy"] == precision.choose("auto", device_kind="cpu").policy
    assert data["tf_config"] is None
    assert data["horovod"]["status"] == horovod_support.report()["status"]
    assert data["strategies"] == strategies.strategy_names()


def test_report_parses_tf_config():
    tf_config = {"cluster": {"worker": ["localhost:1234", "localhost:1235"]}, "task": {"type": "worker", "index": 1}}
    data = report({"TF_CONFIG": json.dumps(tf_config)})
    assert data["tf_config"]["num_workers"] == 2 and data["tf_config"]["is_chief"] is False


def test_report_explains_an_invalid_tf_config():
    data = report({"TF_CONFIG": '{"cluster": {}}'})
    assert data["tf_config"]["error"].startswith("TF_CONFIG is invalid")


def test_text_report():
    result = run_module("tfdist.cli.env", [], timeout=120)
    assert result.returncode == 0
    assert "--precision=auto would choose:" in result.stdout and "tensorflow: " in result.stdout


def test_report_has_gpu_build_driver_and_ssh():
    data = report()
    build = tf.sysconfig.get_build_info()
    assert data["gpu_build"]["is_cuda_build"] == bool(build.get("is_cuda_build"))
    assert data["gpu_build"]["cuda_version"] == build.get("cuda_version")
    assert data["gpu_build"]["cudnn_version"] == build.get("cudnn_version")
    assert "nccl_version" in data["gpu_build"]
    if not os.path.exists("/proc/driver/nvidia/version") and not shutil.which("nvidia-smi"):
        assert data["gpu_driver_version"] is None
    assert data["ssh_client"]["present"] == (shutil.which("ssh") is not None)
    if data["ssh_client"]["present"]:
        assert data["ssh_client"]["version"].startswith("OpenSSH")


@pytest.mark.parametrize("text, expected", [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
     "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n", "535.104.05"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  (dvs-builder@U16-I3-B03-4-3)"
     "  Thu Jan 23 23:08:25 UTC 2025\n", "570.86.15"),
])
def test_driver_version_from_the_proc_file(tmp_path, text, expected):
    from tfdist.cli import env

    (tmp_path / "version").write_text(text)
    assert env.gpu_driver_version(str(tmp_path / "version")) == expected
