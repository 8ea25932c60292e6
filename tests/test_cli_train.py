"""tfdist.cli.train: the command as users run it, in real subprocesses.

Bad input must exit non-zero with one short paragraph and no traceback;
interrupted runs (SIGKILL, SIGTERM) must resume at the step they reached.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, run_module, run_train, subprocess_env
from tests.idx_files import write_mnist_dir
from tfdist.mnist import data


def assert_user_error(result, *fragments):
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [l for l in result.stderr.splitlines() if l.startswith("tfdist-train: error: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def assert_evaluated(metrics, examples):
    """metrics.json: the evaluation counted `examples`, and its accuracy is a whole number of them right."""
    assert metrics["eval_examples"] == examples, metrics
    correct = metrics["eval_accuracy"] * examples
    assert abs(correct - round(correct)) < 1e-3, (correct, examples)


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--strategy=nccl_magic"], ["--strategy='nccl_magic' is not a known strategy; valid strategies are: auto"]),
        (["--global_batch_size=64", "--per_replica_batch_size=32"], ["were both set", "Set only one of them"]),
        (["--strategy=mirrored", "--num_cpu_replicas=3", "--global_batch_size=128"],
         ["does not divide evenly across 3 replica(s)", "use a multiple of 3"]),
        (["--strategy=mirrored", "--num_cpu_replicas=4", "--global_batch_size=2"],
         ["smaller than the number of replicas (4)"]),
        (["--strategy=mirrored", "--num_cpu_replicas=0"], ["--num_cpu_replicas=0 is below 1"]),
        (["--precision=float64"], ["--precision='float64' is not a valid choice"]),
        (["--dataset=idx:/nonexistent/mnist"], ["--dataset=idx:/nonexistent/mnist: no such directory"]),
        (["--dataset=imagenet"], ["--dataset='imagenet' is not a known data source"]),
        (["--strategy=tpu", "--tpu=local", "--precision=mixed_float16"], ["mixed_float16"]),
        (["--strategy=horovod"], ["must be started by horovodrun"]),
        (["--strategy=default", "--hvd_op=adasum"], ["Horovod options but --strategy=default"]),
        (["--strategy=horovod", "--hvd_compression=bf16"], ["--hvd_compression='bf16' is not a valid choice"]),
        (["--strategy=parameter_server"], ["needs a cluster with a chief, workers and ps tasks"]),
        (["--strategy=parameter_server", "--num_cpu_replicas=2"], ["--num_cpu_replicas applies to --strategy=mirrored"]),
        (["--strategy=parameter_server", "--all_reduce=ring"], ["--all_reduce=ring has no effect with --strategy=parameter_server"]),
        (["--strategy=mirrored", "--ps_shards=2"], ["--ps_shards applies to --strategy=parameter_server"]),
        (["--num_cpu_replicas=2", "--all_reduce=ring"],
         ["--strategy=auto chose mirrored", "--all_reduce='ring' is not valid with --strategy=mirrored"]),
    ],
)
def test_bad_input_is_one_paragraph_and_exit_2(tmp_path, args, fragments):
    result = run_train([f"--workdir={tmp_path / 'w'}", *args], timeout=120)
    assert_user_error(result, *fragments)
    assert not (tmp_path / "w" / "checkpoints").exists()


def test_corrupt_idx_dataset_names_the_file(tmp_path):
    directory = tmp_path / "idx"
    digits = data.load_dataset("mnist")
    write_mnist_dir(str(directory), digits.train_images[:200, ..., 0], digits.train_labels[:200],
                    digits.eval_images[:50, ..., 0], digits.eval_labels[:50])
    broken = directory / "train-images-idx3-ubyte"
    broken.write_bytes(broken.read_bytes()[:5000])
    result = run_train([f"--workdir={tmp_path / 'w'}", f"--dataset=idx:{directory}"], timeout=120)
    assert_user_error(result, f"IDX file {broken} declares shape (200, 28, 28)", "truncated")


def test_idx_directory_of_real_files_trains(tmp_path):
    """The real, published t10k IDX files bundled with tfdist (one gzip, one plain) plus a train split."""
    directory = tmp_path / "idx"
    digits = data.load_dataset("mnist")
    write_mnist_dir(str(directory), digits.train_images[..., 0], digits.train_labels,
                    digits.eval_images[:1, ..., 0], digits.eval_labels[:1])
    for name in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        os.remove(directory / name)
    shutil.copy(os.path.join(data.BUNDLED_DIR, "t10k-images-idx3-ubyte.gz"), directory)
    import gzip

    with gzip.open(os.path.join(data.BUNDLED_DIR, "t10k-labels-idx1-ubyte.gz")) as f:
        (directory / "t10k-labels-idx1-ubyte").write_bytes(f.read())
    result = run_train([f"--workdir={tmp_path / 'w'}", f"--dataset=idx:{directory}", "--epochs=3"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "w" / "metrics.json").read_text())
    assert metrics["dataset"] == f"idx:{directory}"
    assert_evaluated(metrics, 10000)
    assert metrics["eval_accuracy"] >= 0.95  # 8,000 of the 10,000 eval digits were trained on.


def test_tfds_train_split_streams_to_two_workers(tmp_path, tiny_digits_dir):
    """tfds:NAME on 2 MultiWorkerMirrored workers: each streams 2 of the 4 train files (tfds shards by input context).

    The processes lack tiny_digits' builder code: tfds finds the prepared files in --data_dir by name.
    """
    result = run_module("tfdist.cli.launch", [
        "--num_workers=2", "--", sys.executable, "-m", "tfdist.cli.train", "--strategy=multi_worker_mirrored",
        "--dataset=tfds:tiny_digits", f"--data_dir={tiny_digits_dir}", "--epochs=3", "--global_batch_size=64",
        f"--workdir={tmp_path / 'w'}"], timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    for worker in (0, 1):
        assert f"Input pipeline {worker} of 2: tfds:tiny_digits train split streamed from 2 of its 4 file(s)" in output
    metrics = json.loads((tmp_path / "w" / "metrics.json").read_text())
    assert (metrics["num_workers"], metrics["train_input"], metrics["steps"]) == (2, "streamed", 3 * 31)
    assert_evaluated(metrics, 500)
    assert metrics["eval_accuracy"] >= 0.90  # Measured 0.930-0.942, seeds 0-2.


def test_flagfile_repeats_a_run_and_flags_override(tmp_path):
    first = run_train([f"--workdir={tmp_path / 'a'}", "--max_steps=6", "--precision=float32"], timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    flagfile = tmp_path / "a" / "flags.txt"
    assert "--max_steps=6" in flagfile.read_text()
    second = run_train([f"--flagfile={flagfile}", f"--workdir={tmp_path / 'b'}"], timeout=120)
    assert second.returncode == 0, second.stderr[-3000:]
    metrics = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert (metrics["steps"], metrics["precision"]) == (6, "float32")
    # Every process ends its output with its own weights fingerprint.
    assert second.stdout.strip().splitlines()[-1].endswith(f"weights_fingerprint={metrics['weights_fingerprint']}")


def _start(tmp_path, *args):
    return subprocess.Popen(
        [sys.executable, "-m", "tfdist.cli.train", f"--workdir={tmp_path / 'w'}", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env(), cwd=REPO,
    )


def _wait_for_checkpoint(tmp_path, proc, timeout=120):
    deadline = time.time() + timeout
    index = tmp_path / "w" / "checkpoints" / "checkpoint"
    while time.time() < deadline:
        if index.exists() and proc.poll() is None:
            return
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.02)
    raise AssertionError("no checkpoint appeared")


def _latest_step(tmp_path):
    text = (tmp_path / "w" / "checkpoints" / "checkpoint").read_text()
    return int(re.search(r'model_checkpoint_path: "ckpt-(\d+)"', text).group(1))


SLOW = ["--steps_per_execution=1", "--checkpoint_every_steps=20", "--epochs=5"]


def test_killed_run_resumes_at_its_checkpoint(tmp_path):
    proc = _start(tmp_path, *SLOW)
    _wait_for_checkpoint(tmp_path, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    step = _latest_step(tmp_path)
    assert 0 < step < 310 and not (tmp_path / "w" / "metrics.json").exists()
    result = run_train([f"--workdir={tmp_path / 'w'}", *SLOW], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # The killed run's lock died with it (the kernel released it); its record is taken over.
    assert f"Took over the lock of --workdir={tmp_path / 'w'} from a run that is gone" in result.stderr
    assert f"pid {proc.pid}," in result.stderr
    assert re.search(rf"Resuming from checkpoint \S+ckpt-{step} at step {step}\.", result.stderr)
    metrics = json.loads((tmp_path / "w" / "metrics.json").read_text())
    assert (metrics["resumed_from_step"], metrics["steps"]) == (step, 310)
    assert metrics["eval_accuracy"] >= 0.97


def test_second_run_on_a_live_workdir_is_refused_at_once(tmp_path):
    proc = _start(tmp_path, *SLOW)
    try:
        _wait_for_checkpoint(tmp_path, proc)
        start = time.time()
        second = run_train([f"--workdir={tmp_path / 'w'}", *SLOW], timeout=120)
        assert time.time() - start < 30
        assert_user_error(second, f"--workdir={tmp_path / 'w'} is in use by another live run (host ",
                          f"pid {proc.pid}, since ")
        assert proc.poll() is None, "the first run did not survive the second"
        before = _latest_step(tmp_path)
        deadline = time.time() + 120
        while _latest_step(tmp_path) == before and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        # It still checkpoints, or it ran its last steps while the second run was refused and ended well (a
        # loaded CI machine: both seen).
        assert _latest_step(tmp_path) > before or proc.poll() == 0, "no new checkpoint, and the run did not end well"
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_sigterm_saves_then_resumes(tmp_path):
    proc = _start(tmp_path, *SLOW)
    _wait_for_checkpoint(tmp_path, proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, output[-3000:]
    match = re.search(r"stopped by a signal at step (\d+); checkpoint \S+ckpt-(\d+) was saved", output)
    assert match and match.group(1) == match.group(2), output[-3000:]
    step = int(match.group(1))
    assert _latest_step(tmp_path) == step
    result = run_train([f"--workdir={tmp_path / 'w'}", *SLOW], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"at step {step}." in result.stderr
    metrics = json.loads((tmp_path / "w" / "metrics.json").read_text())
    assert (metrics["resumed_from_step"], metrics["steps"]) == (step, 310)


@pytest.mark.parametrize("text, named", [
    ("From /job:worker/replica:0/task:1: failed to connect to /job:ps/replica:0/task:0", "/job:ps/replica:0/task:0"),
    ("Socket closed /job:worker/replica:0/task:1", "/job:worker/replica:0/task:1"),
    ("Socket closed", "another task of the job"),
])
def test_a_lost_peer_is_named_and_a_lost_ps_before_the_worker_that_could_not_reach_it(text, named):
    from tfdist.cli.train import describe_lost_peer
    import tensorflow as tf

    said = describe_lost_peer(tf.errors.UnavailableError(None, None, text))
    assert said.startswith(f"lost contact with {'task ' if named.startswith('/') else ''}{named} (UnavailableError: ")
