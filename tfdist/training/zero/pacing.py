"""How many local gradients a sharded step holds at once: each bucket's gradient is made only after the
reduce-scatter of the bucket `SLACK` places later in the model has summed (control edges, graph mode only).

A bucket's reduce-scatter runs as soon as the backward pass has made its gradient, but the backward pass does
not wait for it: where the collectives are slower than a layer's backward pass (CPU replicas of one process,
which share its cores; a slow link) every layer's local gradient is made and waits for its turn, and the
step holds the whole local gradient beside the owned slices (stage 2 with ``grad_accum_steps`` then peaked
above stage 1, which adds each layer's gradient into its accumulator as it is made). DeepSpeed bounds this
with a fixed reduce bucket that the backward pass waits on. Here the ops that make a weight's gradient wait, by
a control edge, for the reduce-scatter `SLACK` buckets later (made earlier in the backward pass): at most
`SLACK` + 1 buckets' local gradients exist at once, and while one bucket's gradient is made the later one's
reduce-scatter runs beside the backward pass through the activations, which is not held.

Only a gradient whose ops feed nothing but its own bucket's reduction is held (a weight gradient that is also
an activation gradient, as BatchNormalization's beta's is, or one read by another bucket's reduction, is
not): then nothing made before the later reduce-scatter waits for it, and no edge the step's collectives
are ordered by later (TensorFlow orders stateful ops as they were made) can close a cycle. The values are
the same to the last bit.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import tensorflow as tf

from tfdist.training.zero import tf_private

SLACK = 1  # A bucket's gradient waits for the reduce-scatter of the bucket this many places later (0: none).
# The ops a gradient passes through after its buffer is made, and which of their inputs carry its data.
_DATA_INPUTS = {"Identity": slice(0, 1), "Cast": slice(0, 1), "Reshape": slice(0, 1),
                "Select": slice(1, 3), "SelectV2": slice(1, 3)}


def pace(grads: Sequence[Any], reduced: Sequence[tf.Tensor], buckets: Sequence[Any], scopes: Sequence[str],
         slack: Optional[int] = None) -> None:
    """Makes the gradient of each bucket k (`grads`, one per variable) after `reduced[k + slack]` (each
    bucket's reduce-scatter, in layout order, made under the name scope ``scopes[k]``); nothing when executing
    eagerly (ops run as they are made), nor on a TensorFlow without the private names it uses."""
    slack = SLACK if slack is None else slack
    if tf.executing_eagerly() or slack < 1 or not tf_private.CONTROL_EDGES:
        return
    for k in range(len(buckets) - slack):
        after = reduced[k + slack].op
        for i in buckets[k].indices:
            if grads[i] is None:
                continue
            chain = _producers(grads[i])
            if any(op.graph is not after.graph for op in chain) or not _feeds_only(chain, scopes[k]):
                continue  # (Made in another graph: a branch's readers of it are not made yet.)
            for op in chain:
                if after not in op.control_inputs:
                    tf_private.add_control_input(op, after)


def _producers(tensor: tf.Tensor, depth: int = 3) -> list:
    """The op that makes `tensor`, and through a cast, reshape or select the ops that make its data."""
    found = [tensor.op]
    inputs = _DATA_INPUTS.get(tensor.op.type)
    if depth and inputs is not None:
        for source in list(tensor.op.inputs)[inputs]:
            found += _producers(source, depth - 1)
    return found


def _feeds_only(chain: list, scope: str) -> bool:
    """Whether every op that reads the outputs of `chain` is in it or in its bucket's reduction (`scope`),
    nothing waits for them by a control edge, and none is stateful (TensorFlow orders stateful ops as they
    were made, which would put one before the later reduce-scatter it would then wait for)."""
    members = set(chain)
    for op in chain:
        if op.op_def.is_stateful or tf_private.control_outputs(op):
            return False
        for consumer in (c for t in op.outputs for c in t.consumers()):
            if consumer not in members and not consumer.name.startswith(scope):
                return False
    return True
