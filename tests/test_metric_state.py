"""tfdist.training.metric_state: metric results computed from the summed states, against Keras' own
fit and evaluate on one device, for a custom metric whose ``result()`` returns its own state variable."""

import subprocess
import sys

import numpy as np
import pytest

import tfdist
from tests import custom_metric
from tests.conftest import REPO, subprocess_env
from tfdist.training.metric_state import MetricLayout

MIRRORED = {"all_reduce": "reduce_to_one"}  # Collective all-reduces of several strategies collide in one process.


def test_results_read_the_summed_states_not_the_variables():
    """The layout's results are the totals' (a metric variable holding something else is not read)."""
    model = custom_metric.model_fn()
    model.evaluate(custom_metric.X, custom_metric.Y, verbose=0)  # Built; the variables hold other counts.
    layout = MetricLayout(model)
    totals = np.zeros(layout.size)
    for index, variable in enumerate(layout.variables):
        if variable.path.endswith("true_positives/ctp"):
            totals[3 + index] = 7.0
    logs = layout.results(totals)
    assert logs["categorical_true_positives"] == 7.0
    assert logs["raw_true_positives"] == 7.0 and logs["raw_doubled"] == 14.0


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_metric_returning_its_variable_evaluates_and_fits_as_keras(replicas):
    """tfdist.evaluate and fit (epoch, validation and per-batch logs) as Keras' on one device (1e-5)."""
    expected, weights = custom_metric.keras_reference()
    keras_batches = custom_metric.BatchLogs()
    custom_metric.model_fn().fit(custom_metric.X, custom_metric.Y, batch_size=custom_metric.BATCH_SIZE, epochs=2,
                                 shuffle=False, verbose=0, callbacks=[keras_batches])
    if replicas > 1:
        strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=replicas, precision="float32", **MIRRORED)
    else:
        strategy = tfdist.make_strategy("one_device", precision="float32")
    with strategy.scope():
        model = custom_metric.model_fn()
    batches = custom_metric.BatchLogs()
    got = custom_metric.keras_run(model, tfdist.fit, tfdist.evaluate, verbose=0, callbacks=[batches])
    custom_metric.check_same(got, expected)
    for a, b in zip(model.get_weights(), weights):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert len(batches.batches) == len(keras_batches.batches)
    for ours, theirs in zip(batches.batches, keras_batches.batches):
        assert set(ours) == set(theirs)
        for key in theirs:
            np.testing.assert_allclose(ours[key], theirs[key], atol=1e-5, err_msg=key)


@pytest.mark.jobs
def test_two_workers_report_a_metric_returning_its_variable_as_keras(tmp_path):
    """On 2 MultiWorkerMirrored workers (the chief showing progress) the job finishes and every task's
    logs and weights are Keras' (tests/programs/custom_metric.py)."""
    result = subprocess.run([sys.executable, "-m", "tfdist.cli.launch", "--num_workers=2", "--", sys.executable,
                             "tests/programs/custom_metric.py", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, cwd=REPO, env=subprocess_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    custom_metric.check_job(str(tmp_path))
