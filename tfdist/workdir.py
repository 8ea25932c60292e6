"""The run directory: configuration, checkpoints, summaries, export, metrics.

Layout of ``--workdir``::

  config.json       the resolved configuration (repeat a run with it)
  flags.txt         the same as an absl flagfile: tfdist-train --flagfile=W/flags.txt
  checkpoints/      tf.train checkpoints (ckpt-STEP), newest kept
  tensorboard/      TensorBoard summaries
  model.keras       the final model
  metrics.json      the run's results

Only the chief writes. Every write that replaces a file goes through a
temporary name and an atomic rename, so a failed run never leaves a half
written export or metrics file, and checkpoints are only ever added (the
CheckpointManager keeps the newest ``--keep_checkpoints``).
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from typing import Any, Optional

import tensorflow as tf

from tfdist.config import RESUME_KEYS, TrainConfig
from tfdist.errors import UserError


def default_workdir(strategy: str) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{stamp}-{strategy}-{os.getpid()}")


class RunDir:
    """The workdir as seen by one process; writes only on the chief."""

    def __init__(self, path: str, *, is_chief: bool):
        self.path = path
        self.is_chief = is_chief
        self._scratch: Optional[str] = None

    def join(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)

    @property
    def checkpoint_dir(self) -> str:
        """Where this process saves checkpoints.

        Non-chief workers of a multi-worker job must take part in every save
        (TensorFlow requires it); they save to a private scratch directory that
        `cleanup()` removes.
        """
        if self.is_chief:
            return self.join("checkpoints")
        if self._scratch is None:
            self._scratch = tempfile.mkdtemp(prefix="tfdist-worker-ckpt-")
        return self._scratch

    def latest_checkpoint(self) -> Optional[str]:
        """The newest checkpoint in the workdir (read by every process to resume)."""
        return tf.train.latest_checkpoint(self.join("checkpoints"))

    def prepare(self, config: TrainConfig) -> Optional[str]:
        """Checks the workdir against `config`; returns the checkpoint to resume from.

        Reads only, on every process; the chief writes the configuration.
        """
        latest = self.latest_checkpoint()
        if latest is None:
            if config.resume:
                raise UserError(
                    f"--resume was given but {self.join('checkpoints')} holds no checkpoint; "
                    "drop --resume to start a new run."
                )
            return None
        if config.resume is False:
            raise UserError(
                f"--workdir={self.path} already holds checkpoint {os.path.basename(latest)} "
                "and --noresume was given; tfdist never overwrites a run. Pick a new "
                "--workdir, or drop --noresume to continue this run."
            )
        saved_path = self.join("config.json")
        if tf.io.gfile.exists(saved_path):
            with tf.io.gfile.GFile(saved_path) as f:
                saved = json.load(f)
            changed = [
                f"--{k} (was {saved.get(k)!r}, now {getattr(config, k)!r})"
                for k in RESUME_KEYS
                if saved.get(k) != getattr(config, k)
            ]
            if changed:
                raise UserError(
                    f"Cannot resume the run in --workdir={self.path}: {', '.join(changed)} "
                    "changed what a training step means. Use the original values or a new --workdir."
                )
        return latest

    def write_config(self, config: TrainConfig) -> None:
        if not self.is_chief:
            return
        self.write_text("config.json", config.to_json() + "\n")
        self.write_text("flags.txt", to_flagfile(config))

    def write_json(self, name: str, values: dict[str, Any]) -> None:
        if self.is_chief:
            self.write_text(name, json.dumps(values, indent=2, sort_keys=True) + "\n")

    def write_text(self, name: str, text: str) -> None:
        if not self.is_chief:
            return
        tf.io.gfile.makedirs(self.path)
        final = self.join(name)
        tmp = f"{final}.tmp-{os.getpid()}"
        with tf.io.gfile.GFile(tmp, "w") as f:
            f.write(text)
        tf.io.gfile.rename(tmp, final, overwrite=True)

    def export_model(self, model: Any, name: str = "model.keras") -> Optional[str]:
        """Saves the model through a temporary file, then renames it into place."""
        if not self.is_chief:
            return None
        tf.io.gfile.makedirs(self.path)
        final = self.join(name)
        with tempfile.TemporaryDirectory(prefix="tfdist-export-") as tmp_dir:
            local = os.path.join(tmp_dir, name)
            model.save(local)
            staged = f"{final}.tmp-{os.getpid()}"
            tf.io.gfile.copy(local, staged, overwrite=True)
            tf.io.gfile.rename(staged, final, overwrite=True)
        return final

    def summary_writer(self) -> tf.summary.SummaryWriter:
        if self.is_chief:
            return tf.summary.create_file_writer(self.join("tensorboard"))
        return tf.summary.create_noop_writer()

    def cleanup(self) -> None:
        if self._scratch is not None:
            tf.io.gfile.rmtree(self._scratch)
            self._scratch = None


def to_flagfile(config: TrainConfig) -> str:
    """The configuration as an absl flagfile (unset optional values omitted)."""
    lines = ["# Repeat this run: tfdist-train --flagfile=<this file>"]
    for key, value in config.to_dict().items():
        if value is None:
            continue
        if isinstance(value, bool):
            lines.append(f"--{key}" if value else f"--no{key}")
        else:
            lines.append(f"--{key}={value}")
    return "\n".join(lines) + "\n"
