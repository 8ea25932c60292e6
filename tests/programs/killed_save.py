"""tfdist-train that SIGKILLs itself in the middle of writing checkpoint ckpt-STEP.

  python tests/programs/killed_save.py STEP WHERE tfdist-train-flags...

WHERE is where the kill lands in TensorFlow's write of ckpt-STEP:
  shards      the variables are on disk in ckpt-STEP_temp/ and nothing final is (before the merge step);
  unrecorded  ckpt-STEP's files are whole, and the `checkpoint` state file does not name it yet (before
              the CheckpointManager records it).
The kill is real (SIGKILL: no handler, no clean-up); only its moment is chosen here, since a kill timed
from outside cannot hit a write of a small model reliably.
"""

import os
import signal
import sys

from tensorflow.python.checkpoint import checkpoint_management
from tensorflow.python.ops import gen_io_ops

STEP, WHERE, FLAGS = int(sys.argv[1]), sys.argv[2], sys.argv[3:]


def _name(prefix) -> str:
    value = prefix.numpy() if hasattr(prefix, "numpy") else prefix
    return os.path.basename(value.decode() if isinstance(value, bytes) else str(value))


def _die_at(prefix) -> None:
    if _name(prefix) == f"ckpt-{STEP}":
        os.kill(os.getpid(), signal.SIGKILL)


if WHERE == "shards":
    _merge = gen_io_ops.merge_v2_checkpoints

    def _merge_or_die(checkpoint_prefixes, destination_prefix, *args, **kwargs):
        _die_at(destination_prefix)
        return _merge(checkpoint_prefixes, destination_prefix, *args, **kwargs)

    gen_io_ops.merge_v2_checkpoints = _merge_or_die
else:
    _record = checkpoint_management.CheckpointManager._record_state

    def _record_or_die(self):
        _die_at(self._latest_checkpoint)
        return _record(self)

    checkpoint_management.CheckpointManager._record_state = _record_or_die

from tfdist.cli import train  # noqa: E402 - after the patches, as a user's program imports it.

sys.argv = ["tfdist-train", *FLAGS]
train.run()
