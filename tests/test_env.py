"""tfdist.cli.env: the diagnostics report."""

import json

import tensorflow as tf

from tests.conftest import run_module
from tfdist import horovod_support, precision, strategies


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
