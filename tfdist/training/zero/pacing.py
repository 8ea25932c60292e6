"""How many local gradients a sharded step holds at once: each bucket's gradient is made only after the
reduce-scatter of the bucket `SLACK` places later in the model has summed (control edges, graph mode only).

A bucket's reduce-scatter runs as soon as the backward pass has made its gradient, but the backward pass does
not wait for it: where the collectives are slower than a layer's backward pass (CPU replicas of one process,
which share its cores; a slow link) every layer's local gradient is made and waits for its turn, and the
step holds the whole local gradient beside the owned slices (stage 2 with ``grad_accum_steps`` then peaked
above stage 1, which adds each layer's gradient into its accumulator as it is made). DeepSpeed bounds this
with a fixed reduce bucket that the backward pass waits on. Here a weight gradient's op waits, by a control
edge, for the reduce-scatter `SLACK` buckets later (made earlier in the backward pass): at most `SLACK` + 1
buckets' local gradients exist at once, and while one bucket's gradient is made the later one's reduce-scatter
runs beside the backward pass through the activations, which is not held (its tensors are a batch wide, not a
layer's weights).

An edge is added only where it cannot close a cycle (the gradient op is not already among the
reduce-scatter's inputs, as a weight read twice can make it): the values are the same to the last bit.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import tensorflow as tf

from tfdist.training.zero import tf_private

SLACK = 1  # A bucket's gradient waits for the reduce-scatter of the bucket this many places later (0: none).
_PASS_THROUGH = ("Identity", "Cast", "Select", "SelectV2", "Reshape")  # Where a gradient's buffer is made before.


def pace(grads: Sequence[Any], reduced: Sequence[tf.Tensor], buckets: Sequence[Any],
         slack: Optional[int] = None) -> None:
    """Makes the gradient of each bucket k (`grads`, one per variable) after `reduced[k + slack]` (each
    bucket's reduce-scatter, in layout order); nothing when executing eagerly (ops run as they are made)."""
    slack = SLACK if slack is None else slack
    if tf.executing_eagerly() or slack < 1:
        return
    for k in range(len(buckets) - slack):
        after = reduced[k + slack].op
        for i in buckets[k].indices:
            if grads[i] is None:
                continue
            for op in _producers(grads[i]):
                if after not in op.control_inputs and not _reaches(op, after):
                    tf_private.add_control_input(op, after)


def _producers(tensor: tf.Tensor, depth: int = 3) -> list:
    """The op that makes `tensor`, and through a cast, reshape or select the ops that make its data."""
    found = [tensor.op]
    if depth and tensor.op.type in _PASS_THROUGH:
        for source in tensor.op.inputs:
            if source.shape.num_elements() == tensor.shape.num_elements():
                found += _producers(source, depth - 1)
    return found


def _reaches(op: tf.Operation, target: tf.Operation) -> bool:
    """Whether `target` already depends on `op` (data or control edges): the graph built so far downstream of
    a weight gradient is its bucket's reduce-scatter, so the search is short."""
    seen, todo = {op}, [op]
    while todo:
        current = todo.pop()
        if current is target:
            return True
        for after in [c for t in current.outputs for c in t.consumers()] + tf_private.control_outputs(current):
            if after not in seen:
                seen.add(after)
                todo.append(after)
    return False
