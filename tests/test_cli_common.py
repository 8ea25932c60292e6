"""tfdist.cli.common: a quiet start that hides only TensorFlow's known start-up lines."""

import os
import subprocess
import sys

from tests.conftest import REPO, subprocess_env


def train_output(tmp_path, env_changes):
    """stdout+stderr of the README's first command, shortened to two steps."""
    env = subprocess_env(env_changes)
    for name in ("TF_CPP_MIN_LOG_LEVEL", "TFDIST_TF_LOGS"):
        if name not in env_changes:
            env.pop(name, None)
    result = subprocess.run([sys.executable, "-m", "tfdist.cli.train", "--max_steps=2", "--epochs=1",
                             f"--workdir={tmp_path / 'w'}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=REPO, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:]
    return result.stdout


def test_a_default_run_starts_quietly(tmp_path):
    output = train_output(tmp_path, {})
    assert "cuInit" not in output and "E0000" not in output and "absl::InitializeLog" not in output, output[:3000]
    assert "oneDNN custom operations" not in output and "cudart_stub" not in output
    first = output.splitlines()[0]
    assert "strategies.py" in first and "--strategy=auto chose" in first, output[:3000]


def test_a_user_set_log_level_and_tfdist_tf_logs_bring_tensorflow_lines_back(tmp_path):
    for env in ({"TF_CPP_MIN_LOG_LEVEL": "0"}, {"TFDIST_TF_LOGS": "1"}):
        output = train_output(tmp_path / next(iter(env)), env)
        assert "absl::InitializeLog" in output, output[:3000]
        if not os.path.exists("/proc/driver/nvidia/version"):
            assert "failed call to cuInit" in output


def test_the_filter_forwards_every_other_line_in_order():
    code = ("import os; from tfdist.cli import common\n"
            "with common._filtered_stderr(list(common.STARTUP_NOISE)):\n"
            "    os.write(2, b'real error 1\\n')\n"
            "    os.write(2, b'WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\\n')\n"
            "    os.write(2, b'I0000 00:00:1.2    42 port.cc:153] oneDNN custom operations are on. You may\\n')\n"
            "    os.write(2, b'E0000 00:00:1.3    42 something.cc:9] real error 2\\n')\n"
            "    os.write(2, b'2026-11-30 20:29:11.987187: E external/local_xla/xla/stream_executor/cuda/cuda_fft.cc:477]"
            " Unable to register cuFFT factory: Attempting to register factory for plugin cuFFT when one has already "
            "been registered\\n')\n"
            "os.write(2, b'after\\n')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
                            cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "real error 1\nE0000 00:00:1.3    42 something.cc:9] real error 2\nafter\n"
