"""Choosing and applying the Keras mixed-precision policy.

`tfdist.make_strategy` leaves Keras' global dtype policy as the user set it
(Keras' default: ``float32``) unless asked: ``precision=None`` (its default)
keeps it, a policy name sets it, and ``auto`` (``tfdist-train``'s default)
chooses. ``auto`` picks, per device kind:
  * TPU: ``mixed_bfloat16`` (the TPU's native fast type);
  * GPU of compute capability >= 8.0 (Ampere and later: bfloat16 tensor cores):
    ``mixed_bfloat16``, which needs no loss scaling;
  * GPU of compute capability 7.x (Volta, Turing: float16 tensor cores only):
    ``mixed_float16``, with loss scaling;
  * CPU with bfloat16 instructions (AMX_BF16 or AVX512_BF16): ``mixed_bfloat16``,
    measured 1.3-1.5x faster than float32 for tfdist's CNN on such CPUs (README);
  * anything else: ``float32``.
``mixed_float16`` runs on CPUs but very slowly (no fast float16 kernels), so
asking for it there gets a warning; TPUs cannot run it at all.
"""

from __future__ import annotations

import dataclasses

import keras
from absl import logging

from tfdist.errors import UserError


@dataclasses.dataclass(frozen=True)
class PrecisionChoice:
    policy: str
    reason: str

    @property
    def loss_scaling(self) -> bool:
        return self.policy == "mixed_float16"


def cpu_bf16_flags() -> list[str]:
    """The bfloat16-related instruction-set flags this CPU reports (Linux only)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return sorted(flags & {"amx_bf16", "avx512_bf16"})
    except OSError:
        pass
    return []


KEPT_REASON = "Keras' global dtype policy, left as it was (make_strategy(precision='auto') chooses one per device)"


def choose(requested: str | None, *, device_kind: str,
           gpu_compute_capability: tuple[int, int] | None = None) -> PrecisionChoice:
    """Resolves `requested` for a device kind ('cpu', 'gpu' or 'tpu'); None keeps Keras' current policy."""
    if requested is None:
        current = keras.config.dtype_policy().name
        if current == "mixed_float16" and device_kind == "tpu":
            raise UserError("Keras' global dtype policy is mixed_float16, which cannot run on TPUs (they have no "
                            "float16 arithmetic); set mixed_bfloat16 or pass precision='auto' to make_strategy.")
        return PrecisionChoice(current, KEPT_REASON)
    if requested == "mixed_float16" and device_kind == "tpu":
        raise UserError(
            "--precision=mixed_float16 cannot run on TPUs (they have no float16 "
            "arithmetic); use --precision=mixed_bfloat16 or --precision=auto."
        )
    if requested != "auto":
        return PrecisionChoice(requested, "requested with --precision")
    if device_kind == "tpu":
        return PrecisionChoice("mixed_bfloat16", "TPU: bfloat16 is its native fast type")
    if device_kind == "gpu":
        if gpu_compute_capability and gpu_compute_capability >= (8, 0):
            return PrecisionChoice(
                "mixed_bfloat16",
                f"GPU compute capability {gpu_compute_capability[0]}.{gpu_compute_capability[1]} >= 8.0 has "
                "bfloat16 tensor cores (no loss scaling needed)",
            )
        if gpu_compute_capability and gpu_compute_capability >= (7, 0):
            return PrecisionChoice(
                "mixed_float16",
                f"GPU compute capability {gpu_compute_capability[0]}.{gpu_compute_capability[1]} "
                "has float16 tensor cores only (loss-scaled)",
            )
        return PrecisionChoice("float32", f"GPU compute capability {gpu_compute_capability} < 7.0")
    flags = cpu_bf16_flags()
    if flags:
        return PrecisionChoice("mixed_bfloat16", f"CPU reports {', '.join(flags)}")
    return PrecisionChoice("float32", "CPU without bfloat16 instructions")


def apply(choice: PrecisionChoice, *, device_kind: str) -> None:
    """Sets the global Keras dtype policy (before the model is built)."""
    if choice.policy == "mixed_float16" and device_kind == "cpu":
        logging.warning(
            "mixed_float16 on a CPU is very slow (about 100x slower than float32 here: "
            "CPUs have no fast float16 kernels). It is meant for GPUs; on CPUs use "
            "--precision=mixed_bfloat16 or float32."
        )
    keras.mixed_precision.set_dtype_policy(choice.policy)
