"""tfdist.training.workdir: the workdir lock, unusable workdirs, failed writes, scratch clean-up.

The lock and the failed writes are provoked for real: other processes hold or
held the lock, a read-only mount refuses the workdir, and a small tmpfs fills
up in the middle of a real ``tfdist-train`` run (in a private mount namespace,
so root is needed; without it those tests are skipped with the reason).
"""

import errno
import json
import os
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
from tfdist.training import workdir
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
    assert sorted(p for p in os.listdir(copy) if not os.path.isdir(copy / p)) == ["config.json", "flags.txt", "plan.json"]
    resumed = run_train([f"--workdir={copy}", *FULL_DISK], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from checkpoint" in resumed.stderr and "ckpt-10 at step 10." in resumed.stderr
    metrics = json.loads((copy / "metrics.json").read_text())
    assert (metrics["resumed_from_step"], metrics["steps"]) == (10, 60)
    assert sorted(os.listdir(copy)) == ["checkpoints", "config.json", "flags.txt", "metrics.json", "model.keras",
                                        "plan.json", "tensorboard"]


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
