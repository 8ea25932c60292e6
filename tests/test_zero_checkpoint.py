"""tfdist.training.zero.checkpoint: the sharded optimizer state's files (checkpoints/zero-STEP/replica-R-of-N)
through faults.

An optimizer without state (plain SGD) writes and reads its shard files; a checkpoint whose shards do not
read back whole is skipped for the one before; a 3-worker stage-3 job that loses a worker to SIGKILL shrinks
to 2 as the unsharded job does (tests/test_elastic.py: the same undisturbed runs); a worker SIGKILLed while it
writes its shard of step 15 leaves ckpt-15 unrecorded, and the job resumes from ckpt-10 to Keras' weights.
Float32, fixed batches.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.conftest import REPO, subprocess_env
from tests.test_elastic import assert_shrunk_to_the_same_weights, elastic_references, shrinking_job  # noqa: F401
from tests.zero_model import BATCH, data, keras_weights, model
from tfdist.training.fitting import train


def sharded_fit(replicas, optimizer, **kwargs):
    """Stage 1 on `replicas` in-process replicas (reduce_to_one: no collective ops in the test process)."""
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=replicas, precision="float32",
                                    all_reduce="reduce_to_one") if replicas > 1 \
        else tfdist.make_strategy("default", precision="float32")
    with strategy.scope():
        net = model(optimizer)
    x, y = data()
    result = train(net, x, y, batch_size=BATCH, shuffle=False, verbose=0, strategy=strategy, export=(), **kwargs)
    return net, result


def close(a, b, atol):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, atol=atol, rtol=0)


def shard_files(checkpoints, step):
    """The files of zero-STEP: the replicas whose bundle is whole (index and data), and every other file."""
    names, data = set(os.listdir(checkpoints / f"zero-{step}")), ".data-00000-of-00001"
    whole = {n[:-len(".index")] for n in names if n.endswith(".index") and n[:-len(".index")] + data in names}
    return whole, sorted(names - {n + suffix for n in whole for suffix in (".index", data)})


def replicas_of(count):
    return {f"replica-{r}-of-{count}" for r in range(count)}


def test_plain_sgd_without_optimizer_state_saves_its_shards_and_resumes_on_another_count(tmp_path):
    """Plain SGD has no optimizer state: each replica's file is still written (it failed at the first
    checkpoint: SaveV2 of no tensors), and read back on 1 replica: Keras' 20 steps."""
    sgd = lambda: keras.optimizers.SGD(0.05)  # noqa: E731
    run = tmp_path / "run"
    sharded_fit(2, sgd, zero_stage=1, max_steps=10, workdir=str(run), checkpoint_every_steps=5)
    assert [shard_files(run / "checkpoints", step) for step in (5, 10)] == [(replicas_of(2), [])] * 2
    net, result = sharded_fit(1, sgd, zero_stage=1, workdir=str(run))
    assert (result.resumed_from, result.steps) == (10, 20)
    close(net.get_weights(), keras_weights(sgd), 1e-5)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("damage, why", [
    (lambda shards: os.remove(shards / "replica-1-of-2.index"), "zero-10 lacks a replica's file"),
    (lambda shards: _truncate(shards / "replica-0-of-2.data-00000-of-00001"),
     "zero-10: Read less bytes than requested")], ids=["a_file_missing", "a_file_truncated"])
def test_a_checkpoint_whose_shards_do_not_read_back_whole_is_skipped_for_the_one_before(tmp_path, caplog, damage,
                                                                                       why):
    """ckpt-10 reads back whole, but its sharded state does not: a killed copy of the workdir left replica 1's
    index out, or a full disk cut replica 0's data. The run resumes from ckpt-5 with one log line, as from a
    damaged ckpt-10, writes a whole zero-10 again and ends with Keras' 20 steps. (It failed: the missing index
    stopped the run with a WriteError calling ckpt-10 intact, the truncated data with an IndexError traceback.)"""
    run = tmp_path / "run"
    sharded_fit(2, None, zero_stage=1, max_steps=10, workdir=str(run), checkpoint_every_steps=5)
    damage(run / "checkpoints" / "zero-10")
    with caplog.at_level("INFO", logger="absl"):  # absl's own level may be WARNING here.
        net, result = sharded_fit(2, None, zero_stage=1, workdir=str(run), checkpoint_every_steps=5)
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Skipped")]
    assert skipped == [f"Skipped damaged checkpoint ckpt-10 ({why}) in {run / 'checkpoints'}; resuming from ckpt-5."]
    assert (result.resumed_from, result.steps) == (5, 20)
    assert shard_files(run / "checkpoints", 10) == (replicas_of(2), [])
    close(net.get_weights(), keras_weights(), 1e-5)


@pytest.mark.jobs
def test_a_sharded_job_that_loses_a_worker_shrinks_as_the_unsharded_job(tmp_path, elastic_references):
    """tests/test_elastic.py's shrink with --zero_stage=3 (each layer's weights in thirds, then halves; the
    relaunched workers take their shards from the checkpoint's whole weights): the same relaunch, membership and
    resumed step, within 1e-4 of the same undisturbed unsharded runs on 3 and 2 replicas; shards of 3 replicas up
    to the step it resumed from, of 2 after it (every checkpoint kept). Stage 2's shards resuming on another
    count: tests/test_zero.py."""
    job = shrinking_job(tmp_path, "--zero_stage=3", "--keep_checkpoints=4")
    resumed = assert_shrunk_to_the_same_weights(job, tmp_path / "w", elastic_references)
    checkpoints = tmp_path / "w" / "checkpoints"
    assert json.loads((tmp_path / "w" / "plan.json").read_text())["sharded_optimizer_state"]
    assert json.loads((tmp_path / "w" / "metrics.json").read_text())["zero_stage"] == 3
    for step in (10, 20, 30, 40):
        assert shard_files(checkpoints, step) == (replicas_of(3 if step <= resumed else 2), []), step


def launch(args, timeout=300):
    return subprocess.run([sys.executable, "-m", "tfdist.cli.launch", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=subprocess_env())


@pytest.mark.jobs
def test_a_worker_killed_while_it_writes_its_shard_resumes_from_the_previous_checkpoint(tmp_path):
    """2 MultiWorkerMirrored workers, stage 2, checkpoints every 5 of 20 steps: worker:1 is SIGKILLed just before
    it writes its file of zero-15 (worker:0's whole or not yet). ckpt-15 must not be recorded, so the job
    relaunched resumes from ckpt-10 (not from a zero-15 without replica 1's file) and ends as the undisturbed
    sharded run and Keras' own fit."""
    run, marker = tmp_path / "run", tmp_path / "killed"
    checkpoints = run / "checkpoints"
    command = ["--num_workers=2", "--", sys.executable, "tests/programs/killed_zero_save.py", "15", "1", str(marker),
               str(tmp_path), "multi_worker_mirrored", "2", "20", str(run)]
    killed = launch(command)
    output = killed.stdout + killed.stderr
    assert killed.returncode != 0 and marker.exists(), output[-3000:]  # worker:1 killed; worker:0 lost it.
    assert tf.train.latest_checkpoint(str(checkpoints)).endswith("ckpt-10")
    assert "replica-1-of-2" not in shard_files(checkpoints, 15)[0]
    resumed = launch(command)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    membership = json.loads((run / "membership.json").read_text())
    assert [(m["step"], m["num_workers"], m["num_replicas"]) for m in membership] == [(0, 2, 2), (10, 2, 2)]
    for step in (10, 15, 20):
        assert shard_files(checkpoints, step) == (replicas_of(2), []), step
    tasks = [np.load(tmp_path / f"task{i}.npz") for i in (0, 1)]
    weights = [[task[f"arr_{k}"] for k in range(6)] for task in tasks]
    assert int(tasks[0]["steps"]) == 20
    close(weights[1], weights[0], 0)
    undisturbed, _ = sharded_fit(2, None, zero_stage=2, grad_accum_steps=2, max_steps=20)
    close(weights[0], undisturbed.get_weights(), 1e-6)
    close(weights[0], keras_weights(), 1e-5)
