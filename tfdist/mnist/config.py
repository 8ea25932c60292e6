"""The frozen run configuration and its validation.

`TrainConfig` is the one object that flows from an entry point into the library.
It is immutable; `validate()` checks everything that can be checked without
touching TensorFlow or the filesystem (flag-rule: validators never do I/O) and
raises `UserError` with a message that names the bad value and a valid one.
Checks that need the resolved backend (replica counts, devices) live in
`tfdist.mnist.batching` and `tfdist.precision`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

from tfdist.distribute.options import StrategyOptions
from tfdist.errors import UserError

LR_SCALINGS = ("none", "linear", "sqrt")
LR_SCHEDULES = ("cosine", "constant")
OPTIMIZERS = ("adam", "sgd")
DEFAULT_GLOBAL_BATCH_SIZE = 128

@dataclasses.dataclass(frozen=True)
class TrainConfig(StrategyOptions):
    """Everything one training run needs. Defaults train MNIST offline.

    The backend fields (strategy, all_reduce, tpu, precision, ...) are
    `StrategyOptions`'; the rest are the program's own.
    """

    # Data.
    dataset: str = "mnist"
    data_dir: Optional[str] = None
    download: bool = False
    # Optimisation.
    epochs: int = 5
    global_batch_size: Optional[int] = None
    per_replica_batch_size: Optional[int] = None
    optimizer: str = "adam"
    learning_rate: float = 3e-3
    lr_scaling: str = "none"
    warmup_epochs: float = 0.0
    lr_schedule: str = "cosine"
    grad_accum_steps: int = 1
    zero_stage: int = 0
    steps_per_execution: Optional[int] = None
    jit_compile: str = "auto"
    # tfdist-train chooses the policy for the device (make_strategy keeps the user's unless asked).
    precision: str = "auto"
    seed: int = 0
    # Run directory.
    workdir: Optional[str] = None
    resume: Optional[bool] = None
    checkpoint_every_steps: int = 0
    checkpoint_every_secs: float = 0.0
    keep_checkpoints: int = 3
    max_steps: Optional[int] = None
    summary_every_steps: int = 0
    profile_steps: Optional[str] = None
    export: str = "keras"
    stop_on_nonfinite: bool = True  # tfdist-train stops at a non-finite loss (tfdist.fit goes on by default).

    def validate(self) -> "TrainConfig":
        """Raises `UserError` for values no backend could accept."""
        super().validate()
        _choice("lr_scaling", self.lr_scaling, LR_SCALINGS)
        _choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("jit_compile", self.jit_compile, ("auto", "true", "false"))
        if self.summary_every_steps < 0:
            raise UserError(f"--summary_every_steps={self.summary_every_steps} must be 0 (after every execution) "
                            "or a positive step count.")
        self.profile_range()
        self.export_formats()
        if self.global_batch_size is not None and self.per_replica_batch_size is not None:
            raise UserError(
                f"--global_batch_size={self.global_batch_size} and "
                f"--per_replica_batch_size={self.per_replica_batch_size} were both set; "
                "they are two ways to say the same thing. Set only one of them."
            )
        _positive("global_batch_size", self.global_batch_size)
        _positive("per_replica_batch_size", self.per_replica_batch_size)
        _positive("epochs", self.epochs)
        _positive("grad_accum_steps", self.grad_accum_steps)
        _positive("steps_per_execution", self.steps_per_execution)
        _positive("max_steps", self.max_steps)
        _positive("keep_checkpoints", self.keep_checkpoints)
        if self.learning_rate <= 0:
            raise UserError(
                f"--learning_rate={self.learning_rate} must be positive, e.g. 0.001."
            )
        if self.warmup_epochs < 0:
            raise UserError(f"--warmup_epochs={self.warmup_epochs} must be 0 or more.")
        if self.checkpoint_every_steps < 0:
            raise UserError(
                f"--checkpoint_every_steps={self.checkpoint_every_steps} must be 0 "
                "(checkpoint at each epoch end only) or a positive step count."
            )
        if not self.checkpoint_every_secs >= 0:
            raise UserError(f"--checkpoint_every_secs={self.checkpoint_every_secs} must be 0 (off) or a positive "
                            "number of seconds.")
        return self

    def profile_range(self) -> Optional[tuple[int, int]]:
        """``--profile_steps=START,END`` as two step numbers (None when unset)."""
        if self.profile_steps is None:
            return None
        parts = str(self.profile_steps).split(",")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or int(parts[0]) >= int(parts[1]):
            raise UserError(f"--profile_steps={self.profile_steps!r} must be START,END with START < END, e.g. "
                            "--profile_steps=5,10 (the steps whose trace is written to WORKDIR/tensorboard).")
        return int(parts[0]), int(parts[1])

    def export_formats(self) -> tuple[str, ...]:
        """``--export`` as a tuple of formats (``keras``, ``saved_model``)."""
        from tfdist.training.export import parse_export_formats  # Pure parsing; imports Keras, not TensorFlow.

        return parse_export_formats(self.export)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise UserError(
                f"Unknown configuration field(s) {unknown}; valid fields are "
                f"{sorted(known)}."
            )
        return cls(**values)

    def to_flagfile(self) -> str:
        """The configuration as an absl flagfile (unset optional values omitted)."""
        lines = ["# Repeat this run: tfdist-train --flagfile=<this file>"]
        for key, value in self.to_dict().items():
            if value is None:
                continue
            if isinstance(value, bool):
                lines.append(f"--{key}" if value else f"--no{key}")
            else:
                lines.append(f"--{key}={value}")
        return "\n".join(lines) + "\n"


def _choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise UserError(
            f"--{name}={value!r} is not a valid choice; use one of: {', '.join(valid)}."
        )


def _positive(name: str, value: Optional[int]) -> None:
    if value is not None and value < 1:
        raise UserError(f"--{name}={value} must be a positive integer (1 or more).")
