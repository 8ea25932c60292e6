"""ZeRO-style sharding over the data-parallel replicas (`tfdist.fit(zero_stage=1|2|3)`): equal flat shards.

The trainable variables are flattened into buckets (`layout`); each replica owns exactly 1/N of each bucket's
elements and keeps the optimizer state of those only, in a clone of the user's own Keras optimizer built on
its flat shards (`optimizer`, with what Keras computes per variable made exact in `figures`). A step
reduce-scatters the gradients, each bucket's made once the next one's has summed (`pacing`), and all-gathers
the updated shards (`collectives`, TensorFlow's private names kept in `tf_private`); the state is saved by
variable, so any replica count reads it (`checkpoint`). A user's optimizer built before fit hands its state
over and has its own slots freed meanwhile (`handover`). Stage 3 shards the weights too, gathering each layer's
just before it runs (`stage3`, `gathering`).
docs/sharding.md.

The rest of tfdist uses this surface only: `for_model`, `carry_over`, `state_report`, `ShardedOptimizer` (its `reduce`,
`apply`, `scale_loss`, `finalize`, `save`, `restore`, `loss_scale`, `current_scale`, `stage`) and `STAGES`.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import keras
import numpy as np

from tfdist.distribute.backend import Backend
from tfdist.training.zero import layout
from tfdist.training.zero.sharded import ShardedOptimizer

STAGES = (0, 1, 2, 3)
__all__ = ["STAGES", "ShardedOptimizer", "carry_over", "for_model", "state_report"]

_SHARDED: "weakref.WeakKeyDictionary[Any, ShardedOptimizer]" = weakref.WeakKeyDictionary()


def for_model(model: keras.Model, backend: Backend, stage: int) -> ShardedOptimizer:
    """The model's sharded optimizer state: the one an earlier `tfdist.fit` call left (so a second call goes on
    from the first's moments, as Keras' second ``fit`` does), or a new one."""
    from tfdist.training.zero.stage3 import Stage3Optimizer
    kind = Stage3Optimizer if stage == 3 else ShardedOptimizer
    previous = _SHARDED.get(model.optimizer)
    if _goes_on(previous, model, backend) and type(previous) is kind:
        previous.stage = stage
        return previous
    sharded = _SHARDED[model.optimizer] = kind(model, backend, stage)
    return sharded


def carry_over(model: keras.Model, backend: Backend, stage: int) -> None:
    """Before a fit at `stage` (0: unsharded), with the model built: the state an earlier sharded fit left in
    its shards alone (the user's optimizer was not built before it), where this fit will not go on from those
    shards (an unsharded fit, or stage 3's layout after stage 1's or 2's, or back), is given to the user's
    optimizer whole first (`handover.take_back`), so this fit goes on from it as Keras' next ``fit`` does."""
    from tfdist.training.zero import handover
    from tfdist.training.zero.stage3 import Stage3Optimizer
    if getattr(model, "optimizer", None) is None:  # Compiled without one (a custom step's own): never sharded.
        return
    previous = _SHARDED.get(model.optimizer)
    if not _goes_on(previous, model, backend):
        return
    if stage and (type(previous) is Stage3Optimizer) == (stage == 3):
        return
    handover.take_back(previous, model)


def _goes_on(previous: Optional[ShardedOptimizer], model: keras.Model, backend: Backend) -> bool:
    """Whether `previous` (an earlier fit's shards) holds the state the model's next fit goes on from."""
    return previous is not None and previous.backend is backend and not previous.broken and \
        not model.optimizer.built and \
        [id(v) for v in previous.variables] == [id(v) for v in model.trainable_variables]


def state_report(zero: Optional[ShardedOptimizer], backend: Backend) -> dict[str, Any]:
    """metrics.json's figures: the optimizer-state bytes each replica holds, and their total."""
    if zero is None:
        return {}
    local = zero.local_state_bytes()
    if backend.num_workers > 1:
        per_replica = [int(b) for b in np.asarray(backend.gather_from_tasks(np.asarray(local, np.int64))).ravel()]
    else:
        per_replica = local
    largest = max((layout.variable_bytes(v) for v in zero.variables), default=0)
    return {"zero_stage": zero.stage, "optimizer_state_bytes_per_replica": per_replica,
            "optimizer_state_bytes_total": int(sum(per_replica)), "largest_variable_bytes": largest}
