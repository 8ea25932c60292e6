"""tfdist.distribute.tpu: the TPU initialisation sequence (against a stand-in), failing fast, TPU-specific policy.

No TPU can be reached from CI, so the TensorFlow calls are replaced by a
recorder and the exact order and arguments are asserted; the TPU training
policy (bfloat16, static shapes, high steps_per_execution) runs for real on the
CPU through a backend that reports itself as a TPU.
"""

import json
import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest
import tensorflow as tf

from tests.conftest import REPO, free_port, run_train, subprocess_env
from tfdist.mnist import data, train
from tfdist import precision
from tfdist.distribute import strategies, tpu
from tfdist.distribute.backend import Backend
from tfdist.mnist.config import TrainConfig
from tfdist.errors import UserError


class RecordingCalls(tpu.TPUCalls):
    def __init__(self, fail_at=None, hang_at=None):
        self.calls = []
        self.fail_at, self.hang_at = fail_at, hang_at
        self.resolver_object = object()
        self.strategy_object = object()

    def _step(self, name, *args):
        self.calls.append((name, *args))
        if name == self.hang_at:
            time.sleep(30)
        if name == self.fail_at:
            raise ValueError(f"Could not lookup TPU metadata for {name}")

    def resolver(self, tpu_name, zone, project):
        self._step("resolver", tpu_name, zone, project)
        return self.resolver_object

    def connect_to_cluster(self, resolver):
        self._step("connect_to_cluster", resolver)

    def initialize_tpu_system(self, resolver):
        self._step("initialize_tpu_system", resolver)

    def tpu_strategy(self, resolver):
        self._step("tpu_strategy", resolver)
        return self.strategy_object


GVNIC = ("0x1ae0", "0x0042")
TPU_V4 = ("0x1ae0", "0x005e")
INTEL_BRIDGE = ("0x8086", "0x1237")


def make_sysfs(root, devices):
    """A /sys/bus/pci/devices-like tree: one directory per device with vendor and device files."""
    os.makedirs(root, exist_ok=True)
    for address, (vendor, device) in devices.items():
        os.makedirs(os.path.join(root, address))
        with open(os.path.join(root, address, "vendor"), "w") as f:
            f.write(vendor + "\n")
        with open(os.path.join(root, address, "device"), "w") as f:
            f.write(device + "\n")
    return str(root)


def assert_evaluated(metrics, examples):
    """metrics.json: the evaluation counted `examples`, and its accuracy is a whole number of them right."""
    assert metrics["eval_examples"] == examples, metrics
    correct = metrics["eval_accuracy"] * examples
    assert abs(correct - round(correct)) < 1e-3, (correct, examples)


@pytest.fixture
def fake_tpu_vm(tmp_path):
    """A sysfs tree as on a TPU v4 VM: a TPU chip, gVNIC and an Intel device."""
    return make_sysfs(tmp_path / "sys", {"0000:00:04.0": TPU_V4, "0000:00:05.0": GVNIC,
                                         "0000:00:01.0": INTEL_BRIDGE})


def test_tpu_node_sequence_is_resolve_connect_initialise_strategy():
    calls = RecordingCalls()
    strategy = tpu.connect("my-tpu", zone="us-central1-b", project="my-project", calls=calls)
    r = calls.resolver_object
    assert calls.calls == [
        ("resolver", "my-tpu", "us-central1-b", "my-project"),
        ("connect_to_cluster", r),
        ("initialize_tpu_system", r),
        ("tpu_strategy", r),
    ]
    assert strategy is calls.strategy_object


def test_tpu_vm_sequence_skips_connect(fake_tpu_vm):
    calls = RecordingCalls()
    tpu.connect("local", calls=calls, sysfs=fake_tpu_vm)
    r = calls.resolver_object
    assert calls.calls == [("resolver", "local", None, None), ("initialize_tpu_system", r), ("tpu_strategy", r)]


def test_local_without_tpu_chips_fails_before_any_tensorflow_call(tmp_path):
    calls = RecordingCalls()
    with pytest.raises(UserError, match=r"No TPU was found on this machine: --tpu=local looks for the TPU chips"):
        tpu.connect("local", calls=calls, sysfs=str(tmp_path))
    assert calls.calls == []


def test_misspelled_tpu_name_is_a_clear_error():
    calls = RecordingCalls(fail_at="resolver")
    with pytest.raises(UserError) as e:
        tpu.connect("my-tpuu", calls=calls)
    assert "No TPU was found at --tpu=my-tpuu: resolving the TPU failed (ValueError" in str(e.value)
    assert "--tpu=grpc://HOST:8470" in str(e.value)
    assert [c[0] for c in calls.calls] == ["resolver"]


def test_hanging_initialisation_times_out():
    calls = RecordingCalls(hang_at="initialize_tpu_system")
    start = time.time()
    with pytest.raises(UserError, match="initialising the TPU system did not finish within 1 s"):
        tpu.connect("my-tpu", calls=calls, timeout_s=1.0)
    assert time.time() - start < 5
    assert [c[0] for c in calls.calls] == ["resolver", "connect_to_cluster", "initialize_tpu_system"]


def test_unreachable_grpc_address_fails_at_once():
    calls = RecordingCalls()
    address = f"grpc://127.0.0.1:{free_port()}"
    with pytest.raises(UserError, match=f"No TPU was found at --tpu={address}: nothing answered"):
        tpu.connect(address, calls=calls)
    assert calls.calls == []


def test_detection(fake_tpu_vm, tmp_path):
    assert tpu.local_tpu_devices(fake_tpu_vm) == ["0000:00:04.0"]
    assert tpu.local_tpu_devices(str(tmp_path / "none")) == []
    assert tpu.tpu_detected({"TPU_NAME": "my-tpu"}, sysfs=str(tmp_path / "none"))
    assert tpu.tpu_detected({}, sysfs=fake_tpu_vm)


@pytest.mark.parametrize("device", sorted(tpu.TPU_PCI_DEVICES))
def test_every_tpu_generation_is_detected(tmp_path, device):
    sysfs = make_sysfs(tmp_path / "sys", {"0000:00:04.0": ("0x1AE0", device.upper().replace("0X", "0x"))})
    assert tpu.local_tpu_devices(sysfs) == ["0000:00:04.0"]


def test_gvnic_is_not_a_tpu(tmp_path):
    """Most GCE VMs have gVNIC, a Google (0x1ae0) PCI device that is a network card."""
    sysfs = make_sysfs(tmp_path / "sys", {"0000:00:05.0": GVNIC, "0000:00:01.0": INTEL_BRIDGE})
    assert tpu.local_tpu_devices(sysfs) == []
    assert not tpu.tpu_detected({}, sysfs=sysfs)
    calls = RecordingCalls()
    with pytest.raises(UserError, match="No TPU was found on this machine"):
        tpu.connect("local", calls=calls, sysfs=sysfs)
    assert calls.calls == []


def test_unreadable_or_missing_device_file_is_no_tpu(tmp_path):
    sysfs = make_sysfs(tmp_path / "sys", {"0000:00:04.0": TPU_V4})
    os.remove(os.path.join(sysfs, "0000:00:04.0", "device"))
    assert tpu.local_tpu_devices(sysfs) == []


def _can_fake_sysfs() -> str:
    """Why faking /sys/bus/pci/devices in a mount namespace is impossible here ('' if it is possible)."""
    if os.geteuid() != 0:
        return "needs root to mount a tmpfs over /sys/bus/pci/devices"
    if not shutil.which("unshare") or not os.path.isdir(tpu.PCI_DEVICES_DIR):
        return "needs unshare(1) and /sys/bus/pci/devices"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs none {tpu.PCI_DEVICES_DIR}"],
                           capture_output=True, text=True)
    return "" if probe.returncode == 0 else f"unshare -m + mount not permitted: {probe.stderr.strip()}"


def train_with_fake_pci(tmp_path, devices, args, timeout=180):
    """Runs tfdist-train in a private mount namespace whose /sys/bus/pci/devices holds only `devices`."""
    reason = _can_fake_sysfs()
    if reason:
        pytest.skip(reason)
    tree = make_sysfs(tmp_path / "pci", devices)
    command = [sys.executable, "-m", "tfdist.cli.train", *args]
    script = (f"mount -t tmpfs none {tpu.PCI_DEVICES_DIR} && cp -r {shlex.quote(tree)}/. {tpu.PCI_DEVICES_DIR}/ "
              f"&& exec {shlex.join(command)}")
    env = subprocess_env()
    env.pop("TPU_NAME", None)
    return subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO)


def test_auto_on_a_vm_with_gvnic_trains_with_the_default_strategy(tmp_path):
    result = train_with_fake_pci(tmp_path, {"0000:00:05.0": GVNIC, "0000:00:01.0": INTEL_BRIDGE},
                                 ["--max_steps=2", "--epochs=1", f"--workdir={tmp_path / 'w'}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--strategy=auto chose default" in result.stderr
    metrics = json.loads((tmp_path / "w" / "metrics.json").read_text())
    assert (metrics["strategy"], metrics["steps"]) == ("default", 2)


def test_auto_on_a_tpu_v4_vm_picks_the_tpu_and_fails_fast_here(tmp_path):
    start = time.time()
    result = train_with_fake_pci(tmp_path, {"0000:00:04.0": TPU_V4, "0000:00:05.0": GVNIC},
                                 ["--max_steps=2", "--epochs=1", f"--workdir={tmp_path / 'w'}"])
    assert time.time() - start < 90
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "--strategy=auto chose tpu" in result.stderr
    [line] = [l for l in result.stderr.splitlines() if l.startswith("tfdist-train: error:")]
    assert "--tpu=local" in line and "No TPU" in line, line
    assert not (tmp_path / "w" / "checkpoints").exists()


def test_precision_on_tpu():
    assert precision.choose("auto", device_kind="tpu").policy == "mixed_bfloat16"
    with pytest.raises(UserError, match="mixed_float16 cannot run on TPUs"):
        strategies.build_backend(TrainConfig(strategy="tpu", tpu="local", precision="mixed_float16"))


class SpecRecordingBackend(Backend):
    """A backend that records the `element_spec` of every per-replica dataset it is given."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.specs = []

    def distribute_dataset(self, dataset_fn):
        def recording(context):
            dataset = dataset_fn(context)
            self.specs.append(dataset.element_spec)
            return dataset

        return super().distribute_dataset(recording)


def test_tpu_policy_trains_with_static_shapes_on_cpu(tmp_path):
    """The loop as it runs on a TPU (bfloat16, 100 steps per execution, static
    batches everywhere), on the CPU through a backend that reports a TPU."""
    full = data.load_dataset("mnist")
    digits = data.Digits("subset", full.train_images[:4096], full.train_labels[:4096],
                         full.eval_images[:1001], full.eval_labels[:1001])
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                              cross_device_ops=tf.distribute.ReductionToOneDevice())
    backend = SpecRecordingBackend("tpu", strategy, "tpu")
    config = TrainConfig(workdir=str(tmp_path / "w"), epochs=2, global_batch_size=64)
    metrics = train.train_and_evaluate(config, backend=backend, digits=digits)
    assert (metrics["precision"], metrics["steps_per_execution"]) == ("mixed_bfloat16", 100)
    assert metrics["steps"] == 2 * (4096 // 64)
    assert_evaluated(metrics, 1001)
    assert metrics["eval_accuracy"] > 0.9
    # What a TPU would be fed: every tensor of every input pipeline has a fully static shape,
    # the batch dimension included (1001 eval digits do not fill whole batches: padded, not cut).
    assert backend.specs, "no input pipeline was built through the backend"
    shapes = {tuple(spec.shape.as_list()) for specs in backend.specs for spec in tf.nest.flatten(specs)}
    assert all(None not in shape for shape in shapes), shapes
    train_specs = [specs for specs in backend.specs if len(tf.nest.flatten(specs)) == 2]
    eval_specs = [specs for specs in backend.specs if len(tf.nest.flatten(specs)) == 3]  # (x, y, mask).
    assert train_specs and eval_specs, backend.specs
    assert {tuple(s[0].shape.as_list()) for s in train_specs} == {(32, 28, 28, 1)}  # 64 over 2 replicas.
    assert all(s[0].shape[0] == s[1].shape[0] == s[2].shape[0] for s in eval_specs)


def test_cli_without_a_tpu_fails_within_seconds(tmp_path):
    start = time.time()
    result = run_train(["--strategy=tpu", "--tpu=local", f"--workdir={tmp_path / 'w'}"], timeout=120)
    assert time.time() - start < 60
    assert result.returncode == 2 and "Traceback" not in result.stderr
    [line] = [l for l in result.stderr.splitlines() if l.startswith("tfdist-train: error:")]
    assert "No TPU was found on this machine" in line and "--tpu=local" in line
