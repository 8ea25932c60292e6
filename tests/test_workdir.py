"""tfdist.training.workdir: the workdir lock, unusable workdirs, failed writes, scratch clean-up.

The lock and the failed writes are provoked for real: other processes hold or
held the lock, a read-only mount refuses the workdir, and a small tmpfs fills
up in the middle of a real ``tfdist-train`` run (in a private mount namespace,
so root is needed; without it those tests are skipped with the reason).
"""

import errno
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import tensorflow as tf

from tests.conftest import REPO, run_train, subprocess_env
from tfdist.training import checkpoints, workdir
from tfdist.errors import UserError


def one_error_line(result, code):
    """The single `tfdist-train: error:` paragraph of a failed run (and no traceback)."""
    assert result.returncode == code, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [l for l in result.stderr.splitlines() if l.startswith("tfdist-train: error: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


# The lock -----------------------------------------------------------------------
def test_second_holder_is_refused_naming_the_first_and_release_frees_it(tmp_path):
    path = str(tmp_path / "w")
    with workdir.RunDir(path, is_chief=True) as first:
        assert first.locked
        holder = json.loads((tmp_path / "w" / ".lock").read_text())
        assert (holder["host"], holder["pid"]) == (socket.gethostname(), os.getpid())
        with pytest.raises(UserError) as e:
            workdir.RunDir(path, is_chief=True).acquire()
        message = str(e.value)
        assert f"--workdir={path} is in use by another live run (host {socket.gethostname()}, pid {os.getpid()}" \
            in message
    assert not first.locked and not (tmp_path / "w" / ".lock").exists()
    with workdir.RunDir(path, is_chief=True) as again:  # Free again once released.
        assert again.locked


def test_non_chief_does_not_lock_or_create_the_workdir(tmp_path):
    path = str(tmp_path / "w")
    with workdir.RunDir(path, is_chief=True):
        with workdir.RunDir(path, is_chief=False) as worker:  # Workers of the same job share the workdir.
            assert not worker.locked
    with workdir.RunDir(str(tmp_path / "other"), is_chief=False):
        assert not (tmp_path / "other").exists()


HOLD = ("import sys, time; from tfdist.training.workdir import RunDir; d = RunDir(sys.argv[1], is_chief=True); "
        "d.acquire(); print('locked', flush=True); time.sleep(600)")


def test_lock_of_a_killed_process_is_taken_over_with_a_log_line(tmp_path, caplog):
    path = str(tmp_path / "w")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, path], stdout=subprocess.PIPE, text=True,
                              env=subprocess_env(), cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match=f"pid {holder.pid},"):
            workdir.RunDir(path, is_chief=True).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert json.loads((tmp_path / "w" / ".lock").read_text())["pid"] == holder.pid  # Its record stays behind.
    with caplog.at_level("WARNING"):
        with workdir.RunDir(path, is_chief=True) as rundir:
            assert rundir.locked
    assert f"Took over the lock of --workdir={path} from a run that is gone (host {socket.gethostname()}, " \
           f"pid {holder.pid}" in caplog.text


# Unusable workdirs ----------------------------------------------------------------
def test_workdir_that_is_a_file_or_under_a_file(tmp_path):
    (tmp_path / "f").write_text("not a directory")
    for path, why in ((tmp_path / "f", "it is a file, not a directory"),
                      (tmp_path / "f" / "w", "it cannot be created: Not a directory")):
        for chief in (True, False):
            if not chief and "created" in why:
                continue  # Non-chief workers never create the workdir.
            with pytest.raises(UserError) as e:
                workdir.RunDir(str(path), is_chief=chief).acquire()
            assert str(e.value).startswith(f"--workdir={path} cannot be used as the run directory: {why}")


def test_cli_workdir_that_is_a_file_is_one_paragraph(tmp_path):
    (tmp_path / "f").write_text("not a directory")
    start = time.time()
    line = one_error_line(run_train([f"--workdir={tmp_path / 'f'}", "--max_steps=2"], timeout=120), 2)
    assert time.time() - start < 60
    assert f"--workdir={tmp_path / 'f'} cannot be used as the run directory: it is a file, not a directory" in line
    assert (tmp_path / "f").read_text() == "not a directory"


# Failed writes ----------------------------------------------------------------------
def test_failed_json_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    rundir = workdir.RunDir(str(tmp_path / "w"), is_chief=True)
    rundir.write_json("metrics.json", {"steps": 10})

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tf.io.gfile, "rename", full)
    with pytest.raises(workdir.WriteError) as e:
        rundir.write_json("metrics.json", {"steps": 20})
    assert e.value.exit_code == 1
    assert str(e.value) == (f"Could not write metrics.json to {tmp_path / 'w' / 'metrics.json'}: No space left on "
                            "device. The run stopped before its first checkpoint. Free space and rerun the same "
                            "command to resume.")
    assert sorted(os.listdir(tmp_path / "w")) == ["metrics.json"]
    assert json.loads((tmp_path / "w" / "metrics.json").read_text()) == {"steps": 10}


def test_scratch_is_removed_when_the_run_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    with pytest.raises(RuntimeError):
        with workdir.RunDir(str(tmp_path / "w"), is_chief=False) as rundir:
            scratch = rundir.checkpoint_dir
            assert os.path.isdir(scratch) and scratch.startswith(str(tmp_path))
            raise RuntimeError("a failing step")
    assert not os.path.exists(scratch)


def _root_mounts_reason() -> str:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return "needs root and unshare(1) to mount a small tmpfs in a private mount namespace"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m none /mnt"], capture_output=True,
                           text=True)
    return "" if probe.returncode == 0 else f"unshare -m + mount not permitted: {probe.stderr.strip()}"


def train_on_mount(tmp_path, mount_options, args, copy_to=None, timeout=300):
    """Runs tfdist-train with its workdir on a fresh tmpfs (`mount_options`), then copies the workdir out."""
    reason = _root_mounts_reason()
    if reason:
        pytest.skip(reason)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    command = shlex.join([sys.executable, "-m", "tfdist.cli.train", f"--workdir={mountpoint / 'w'}", *args])
    script = f"mount -t tmpfs -o {mount_options} none {shlex.quote(str(mountpoint))} && {{ {command}; rc=$?; "
    if copy_to is not None:
        script += f"cp -a {shlex.quote(str(mountpoint / 'w'))} {shlex.quote(str(copy_to))}; "
    script += "exit $rc; }"
    return subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=timeout,
                          env=subprocess_env(), cwd=REPO)


def test_cli_workdir_on_a_read_only_mount_is_one_paragraph(tmp_path):
    result = train_on_mount(tmp_path, "ro,size=1m", ["--max_steps=2"])
    line = one_error_line(result, 2)
    assert f"--workdir={tmp_path / 'mnt' / 'w'} cannot be used as the run directory: it cannot be created: " \
           "Read-only file system" in line


FULL_DISK = ["--max_steps=60", "--steps_per_execution=10", "--checkpoint_every_steps=10", "--precision=float32"]


def test_full_disk_stops_the_run_cleanly_and_the_copy_resumes(tmp_path):
    """A 4 MiB workdir holds the first checkpoint (about 2.6 MB with Adam's slots) but not the second."""
    copy = tmp_path / "copy"
    result = train_on_mount(tmp_path, "size=4m", FULL_DISK, copy_to=copy)
    line = one_error_line(result, 1)
    workdir_path = tmp_path / "mnt" / "w"
    assert f"Could not write checkpoint ckpt-20 to {workdir_path / 'checkpoints'}: No space left on device." in line
    assert "its last good checkpoint ckpt-10 is intact. Free space and rerun the same command to resume." in line
    # Nothing of the failed save, and no export or metrics, is left for a resume to pick up.
    assert sorted(os.listdir(copy / "checkpoints")) == ["checkpoint", "ckpt-10.data-00000-of-00001", "ckpt-10.index"]
    assert tf.train.latest_checkpoint(str(copy / "checkpoints")).endswith("ckpt-10")
    assert sorted(p for p in os.listdir(copy) if not os.path.isdir(copy / p)) == [
        "config.json", "flags.txt", "membership.json", "plan.json"]
    resumed = run_train([f"--workdir={copy}", *FULL_DISK], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from checkpoint" in resumed.stderr and "ckpt-10 at step 10." in resumed.stderr
    metrics = json.loads((copy / "metrics.json").read_text())
    assert (metrics["resumed_from_step"], metrics["steps"]) == (10, 60)
    assert sorted(os.listdir(copy)) == ["checkpoints", "config.json", "flags.txt", "membership.json", "metrics.json",
                                        "model.keras", "plan.json", "tensorboard"]


def test_a_failed_summary_write_in_the_loop_becomes_a_write_error(tmp_path):
    """TensorBoard summaries are written by the loop itself; TensorFlow's error names the events file."""
    events = tmp_path / "w" / "tensorboard" / "events.out.tfevents.1.host.7.0.v2"
    with pytest.raises(workdir.WriteError) as e:
        with workdir.RunDir(str(tmp_path / "w"), is_chief=True):
            raise tf.errors.ResourceExhaustedError(
                None, None, "{{function_node __wrapped__WriteSummary_device_/job:localhost/replica:0/task:0/device:"
                f"CPU:0}} {events}; No space left on device\n\tFailed to flush 11 events to {events}")
    assert str(e.value) == (f"Could not write {events}: No space left on device. The run stopped before its first "
                            "checkpoint. Free space and rerun the same command to resume.")
    assert not (tmp_path / "w" / ".lock").exists()


def test_a_damaged_file_in_the_workdir_is_not_called_a_failed_write(tmp_path):
    index = tmp_path / "w" / "checkpoints" / "ckpt-10.index"
    with pytest.raises(workdir.WriteError) as e:
        with workdir.RunDir(str(tmp_path / "w"), is_chief=True):
            raise tf.errors.DataLossError(None, None, f"Unable to open table file {index}: Data loss: not an sstable")
    assert str(e.value).startswith(f"Could not read or write {index}: Unable to open table file {index}: Data loss")


def test_temporaries_of_a_killed_save_are_removed_under_the_lock(tmp_path):
    checkpoints = tmp_path / "w" / "checkpoints"
    (checkpoints / "ckpt-30_temp").mkdir(parents=True)
    (checkpoints / "ckpt-30_temp" / "part-00000-of-00001.data-00000-of-00001.tempstate1").write_bytes(b"x" * 100)
    (checkpoints / "ckpt-20.index").write_bytes(b"kept")
    with workdir.RunDir(str(tmp_path / "w"), is_chief=True):
        assert os.listdir(checkpoints) == ["ckpt-20.index"]


def test_other_errors_pass_through_unchanged(tmp_path):
    elsewhere = tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[1000000000]")
    with pytest.raises(tf.errors.ResourceExhaustedError):
        with workdir.RunDir(str(tmp_path / "w"), is_chief=True):
            raise elsewhere
    with pytest.raises(FileNotFoundError):  # Not a write into the workdir: keeps its type and traceback.
        with workdir.RunDir(str(tmp_path / "w"), is_chief=True):
            open(tmp_path / "absent")


# Checkpoints: what they hold, and resuming from damaged ones -----------------------
def _random_model():
    """Dense -> Dropout -> Dense: the same initial weights and dropout seed on every call."""
    import keras

    init = keras.initializers.GlorotUniform(seed=1)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", kernel_initializer=init),
                              keras.layers.Dropout(0.5, seed=3), keras.layers.Dense(1, kernel_initializer=init)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def _fit_random(path, **kwargs):
    import numpy as np

    import tfdist

    rng = np.random.RandomState(0)
    x = rng.randn(128, 8).astype("float32")
    model = _random_model()
    tfdist.fit(model, x, x[:, :1] * 2.0, batch_size=32, epochs=2, verbose=0, workdir=str(path), export=(),
               steps_per_execution=2, **kwargs)
    return model


def _max_diff(a, b):
    import numpy as np

    return max(float(np.abs(p - q).max()) for p, q in zip(a.get_weights(), b.get_weights()))


def test_resume_with_dropout_is_exact_in_one_process(tmp_path):
    """The Dropout layer's SeedGenerator state is saved (keras' SeedGenerator is not TF-trackable)."""
    whole = _fit_random(tmp_path / "a")
    _fit_random(tmp_path / "b", max_steps=4)  # Epoch 1 of 2, then a new model resumes epoch 2.
    resumed = _fit_random(tmp_path / "b")
    assert _max_diff(whole, _random_model()) > 0.05  # Training moved the weights.
    assert _max_diff(whole, resumed) <= 1e-6
    keys = [name for name, _ in tf.train.list_variables(str(tmp_path / "b" / "checkpoints" / "ckpt-8"))]
    assert "seed_generators/states/0/.ATTRIBUTES/VARIABLE_VALUE" in keys


def test_a_checkpoint_without_seed_state_resumes_with_a_warning(tmp_path, monkeypatch, caplog):
    def old_layout(model, step):  # What tfdist wrote before the seed generators' state was saved.
        return tf.train.Checkpoint(model=model, optimizer=model.optimizer, step=step)

    with monkeypatch.context() as patch:
        patch.setattr(checkpoints, "training_checkpoint", old_layout)
        _fit_random(tmp_path / "w", max_steps=4)
    with caplog.at_level("INFO", logger="absl"):  # absl's own level may be WARNING here.
        _fit_random(tmp_path / "w")
    assert ("Checkpoint ckpt-4 holds no state of the model's 1 random seed generator(s) (Dropout and other random "
            "layers; it was written by an older tfdist): resuming with their current state, so the random masks "
            "of the resumed steps differ from those of an uninterrupted run.") in caplog.text
    assert "at step 4." in caplog.text


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def test_a_damaged_newest_checkpoint_is_skipped_with_one_log_line(tmp_path, caplog):
    whole = _fit_random(tmp_path / "a")
    _fit_random(tmp_path / "b", max_steps=4, checkpoint_every_steps=2)
    checkpoints = tmp_path / "b" / "checkpoints"
    _truncate(checkpoints / "ckpt-4.data-00000-of-00001")  # A full disk or a killed copy.
    with caplog.at_level("INFO", logger="absl"):  # absl's own level may be WARNING here.
        resumed = _fit_random(tmp_path / "b", checkpoint_every_steps=2)
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Skipped")]
    assert skipped == [f"Skipped damaged checkpoint ckpt-4 (Read less bytes than requested) in {checkpoints}; "
                       "resuming from ckpt-2."]
    assert f"Resuming from checkpoint {checkpoints / 'ckpt-2'} at step 2." in caplog.text
    assert _max_diff(whole, resumed) <= 1e-6  # Steps 3-4 ran again, exactly as the first time.


def test_no_whole_checkpoint_is_one_paragraph_naming_each(tmp_path):
    _fit_random(tmp_path / "w", max_steps=4, checkpoint_every_steps=2)
    checkpoints = tmp_path / "w" / "checkpoints"
    os.remove(checkpoints / "ckpt-4.index")
    _truncate(checkpoints / "ckpt-2.data-00000-of-00001")
    model = _random_model()
    with pytest.raises(UserError) as e:
        _fit_random(tmp_path / "w")
    assert str(e.value) == (
        f"Cannot resume the run in --workdir={tmp_path / 'w'}: none of its checkpoints reads back whole: ckpt-4 (its "
        "index file is missing); ckpt-2 (Read less bytes than requested). Restore "
        f"{checkpoints} from a copy, or start a new run with a new --workdir.")
    assert _max_diff(model, _random_model()) == 0.0


def test_two_workers_resume_exactly_past_a_damaged_checkpoint(tmp_path):
    """2 MWMS workers: the seed state is the same on both, and both skip the same damaged checkpoint."""
    import numpy as np

    def launch(workdir, max_steps, out):
        command = [sys.executable, "-m", "tfdist.cli.launch", "--num_workers=2", "--", sys.executable,
                   "tests/programs/dropout_resume.py", "multi_worker_mirrored", str(workdir), str(max_steps),
                   str(out)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO,
                                env=subprocess_env())
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
        return result.stdout + result.stderr

    launch(tmp_path / "a", 0, tmp_path / "out_a")
    launch(tmp_path / "b", 8, tmp_path / "out_b1")  # Epoch 1 of 2: checkpoints at steps 4, 6, 8 kept.
    checkpoints = tmp_path / "b" / "checkpoints"
    _truncate(checkpoints / "ckpt-8.data-00000-of-00001")
    output = launch(tmp_path / "b", 0, tmp_path / "out_b")
    line = (f"Skipped damaged checkpoint ckpt-8 (Read less bytes than requested) in {checkpoints}; resuming from "
            "ckpt-6.")
    assert sorted(re.findall(rf"^\[(worker:\d)\] .*{re.escape(line)}$", output, re.M)) == ["worker:0", "worker:1"]
    whole = [np.load(tmp_path / "out_a" / f"task{i}.npz") for i in (0, 1)]
    resumed = [np.load(tmp_path / "out_b" / f"task{i}.npz") for i in (0, 1)]
    # Two seed generators (Dropout, GaussianNoise), advanced once per step, the same on both workers.
    assert whole[0]["seeds"].shape == (2, 1, 2) and (whole[0]["seeds"][:, :, 1] == 16).all()
    for run in (whole, resumed):
        assert all(np.array_equal(run[0][k], run[1][k]) for k in run[0].files)
    assert np.array_equal(whole[0]["seeds"], resumed[0]["seeds"])
    weights = [k for k in whole[0].files if k != "seeds"]
    assert max(float(np.abs(whole[0][k] - resumed[0][k]).max()) for k in weights) <= 1e-6
    assert max(float(np.abs(whole[0][k] - np.load(tmp_path / "out_b1" / "task0.npz")[k]).max())
               for k in weights) > 0.01  # Epoch 2 moved the weights.


_KILL_FLAGS = ["--precision=float32", "--optimizer=sgd", "--learning_rate=0.05", "--global_batch_size=32",
               "--max_steps=30", "--steps_per_execution=5", "--checkpoint_every_steps=10", "--epochs=1"]


def _fingerprint(output: str) -> str:
    return re.search(r"weights_fingerprint=(\w+)", output).group(1)


@pytest.fixture(scope="module")
def undisturbed_fingerprint(tmp_path_factory):
    result = run_train([*_KILL_FLAGS, f"--workdir={tmp_path_factory.mktemp('undisturbed') / 'w'}"])
    assert result.returncode == 0, result.stderr[-3000:]
    return _fingerprint(result.stdout)


@pytest.mark.parametrize("where", ["shards", "unrecorded"])
def test_a_kill_during_a_checkpoint_write_resumes_from_the_previous_complete_one(tmp_path, where,
                                                                                  undisturbed_fingerprint):
    """SIGKILL inside ckpt-20's write (shards in ckpt-20_temp/; or whole files the state file does not name)."""
    work = tmp_path / "w"
    killed = subprocess.run([sys.executable, "tests/programs/killed_save.py", "20", where, *_KILL_FLAGS,
                             f"--workdir={work}"], capture_output=True, text=True, timeout=300, cwd=REPO,
                            env=subprocess_env())
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    checkpoints = work / "checkpoints"
    left = sorted(os.listdir(checkpoints))
    assert "ckpt-10.index" in left and any(name.startswith("ckpt-20") for name in left), left
    assert tf.train.latest_checkpoint(str(checkpoints)).endswith("ckpt-10")
    resumed = run_train([*_KILL_FLAGS, f"--workdir={work}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = json.loads((work / "metrics.json").read_text())
    assert (metrics["resumed_from_step"], metrics["steps"]) == (10, 30)
    assert not [name for name in os.listdir(checkpoints) if "_temp" in name]
    assert _fingerprint(resumed.stdout) == undisturbed_fingerprint
