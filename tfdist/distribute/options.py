"""What a strategy is built from: its name and the options the flags of the same names set.

`StrategyOptions` is what `tfdist.make_strategy(name, **options)` and the
registry take; the MNIST program's `TrainConfig` carries the same fields and
hands them over with `StrategyOptions.of(config)`. `validate()` checks what
can be checked without TensorFlow; checks that need the machine (GPUs, the
cluster) happen in the registry's builders.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from tfdist.errors import UserError

PRECISIONS = ("auto", "float32", "mixed_float16", "mixed_bfloat16")
# `make_strategy`'s default: Keras' global dtype policy stays as the user set it (tfdist-train's default is "auto").
KEEP_PRECISION = None


def choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise UserError(f"--{name}={value!r} is not a valid choice; use one of: {', '.join(valid)}.")


@dataclasses.dataclass(frozen=True)
class StrategyOptions:
    strategy: str = "auto"
    num_gpus: Optional[int] = None
    num_cpu_replicas: Optional[int] = None
    all_reduce: str = "auto"
    collective_timeout_s: float = 0.0
    tpu: Optional[str] = None
    tpu_zone: Optional[str] = None
    gcp_project: Optional[str] = None
    hvd_compression: Optional[str] = None
    hvd_op: Optional[str] = None
    ps_shards: Optional[int] = None
    precision: Optional[str] = KEEP_PRECISION
    all_reduce_dtype: str = "float32"
    all_reduce_pack_mb: Optional[float] = None  # None: each step's (backend.pack_bytes); 0: one pack (TensorFlow's).

    @classmethod
    def of(cls, source: Any) -> "StrategyOptions":
        """The strategy fields of any object that has them (a `TrainConfig`, or options themselves)."""
        if type(source) is cls:
            return source
        return cls(**{f.name: getattr(source, f.name) for f in dataclasses.fields(cls)})

    def replace(self, **changes: Any) -> "StrategyOptions":
        return dataclasses.replace(self, **changes)

    def validate(self) -> "StrategyOptions":
        if self.precision is not KEEP_PRECISION:
            choice("precision", self.precision, PRECISIONS)
        choice("all_reduce_dtype", self.all_reduce_dtype, ("float32", "bfloat16"))
        if self.all_reduce_pack_mb is not None and self.all_reduce_pack_mb < 0:
            raise UserError(f"--all_reduce_pack_mb={self.all_reduce_pack_mb} must be 0 (one pack: TensorFlow's "
                            "default) or a positive size in MB, e.g. 4; leave it unset for tfdist's choice.")
        if self.hvd_compression is not None:
            choice("hvd_compression", self.hvd_compression, ("none", "fp16"))
        if self.hvd_op is not None:
            choice("hvd_op", self.hvd_op, ("average", "adasum"))
        if self.num_cpu_replicas is not None and self.num_cpu_replicas < 1:
            raise UserError(
                f"--num_cpu_replicas={self.num_cpu_replicas} is below 1; give the number "
                "of logical CPU devices to split the CPU into, e.g. --num_cpu_replicas=2."
            )
        if self.num_gpus is not None and self.num_gpus < 0:
            raise UserError(f"--num_gpus={self.num_gpus} is negative; use 0 or more.")
        if self.collective_timeout_s < 0:
            raise UserError(
                f"--collective_timeout_s={self.collective_timeout_s} must be 0 (no "
                "timeout) or a positive number of seconds."
            )
        return self
