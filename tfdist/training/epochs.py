"""Keras' epochs when `steps_per_epoch` is below the batches of one pass over the data.

Keras' `EpochIterator` keeps its data iterator across epochs while `steps_per_epoch` is given: the second epoch
goes on where the first stopped, and the epoch in which the data runs out ends there, early (Keras warns "Your
input ran out of data"); the next epoch begins a new pass (arrays: a new shuffle). An epoch runs its batches an
execution (`compile(steps_per_execution=)`) at a time and starts a new execution while it has trained fewer than
`steps_per_epoch` batches, so where the execution size does not divide `steps_per_epoch` an epoch trains a whole
last execution past it. `keras_epoch_steps` gives the batches each epoch trains under those rules, for data whose
batches per pass are known (arrays, a dataset of known length).
"""

from __future__ import annotations

import bisect
import functools
import itertools


def keras_epoch_steps(steps_per_epoch: int, batches: int, epochs: int, execution: int = 1) -> tuple[int, ...]:
    """The batches of each of `epochs` epochs: `batches` a pass, `execution` batches an execution."""
    if batches < 1 or steps_per_epoch < 1 or execution < 1:
        raise ValueError("steps_per_epoch, batches and execution must be positive")
    per_epoch = -(-steps_per_epoch // execution) * execution
    lengths, seen = [], 0
    for _ in range(epochs):
        length = min(per_epoch, batches - seen)
        lengths.append(length)
        seen = 0 if seen + length >= batches else seen + length
    return tuple(lengths)


@functools.lru_cache(maxsize=8)
def _starts(epoch_steps: tuple[int, ...]) -> tuple[int, ...]:
    return (0,) + tuple(itertools.accumulate(epoch_steps))


def epoch_start(epoch_steps: tuple[int, ...], epoch: int) -> int:
    """The step `epoch` begins at; past the last epoch, the total."""
    starts = _starts(epoch_steps)
    return starts[min(epoch, len(starts) - 1)]


def epoch_of(epoch_steps: tuple[int, ...], step: int) -> int:
    """The epoch the step after `step` steps belongs to."""
    return bisect.bisect_right(_starts(epoch_steps), step) - 1
