"""configs/: every flagfile starts with the command that uses it and parses into a valid config."""

import glob
import os

import pytest
from absl import flags

from tests.conftest import REPO
from tfdist.cli import train as cli_train
from tfdist.mnist.config import TrainConfig

CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.flags")))


def test_there_is_a_config_per_strategy():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"default.flags", "mirrored_cpu.flags", "mirrored_gpu.flags", "one_device.flags", "multi_worker.flags",
            "parameter_server.flags", "tpu.flags", "horovod.flags"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_names_its_command_and_is_valid(path):
    first = open(path).readline().strip()
    rel = os.path.relpath(path, REPO)
    assert first.startswith("# ") and f"tfdist-train --flagfile={rel}" in first, first
    values = flags.FlagValues()
    for name in TrainConfig.__dataclass_fields__:
        flag = cli_train.FLAGS[name]
        values[name] = flags.Flag(flag.parser, flag.serializer, name, flag.default, flag.help)
    values(["tfdist-train", f"--flagfile={path}", "--epochs=2"])
    config = TrainConfig(**{name: values[name].value for name in TrainConfig.__dataclass_fields__}).validate()
    assert config.epochs == 2  # Command-line flags override the file.
    expected = {"multi_worker": "multi_worker_mirrored", "mirrored_cpu": "mirrored", "mirrored_gpu": "mirrored"}
    stem = os.path.basename(path)[: -len(".flags")]
    assert config.strategy == expected.get(stem, stem)
