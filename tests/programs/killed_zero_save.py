"""tests/programs/zero_job.py that SIGKILLs itself while the sharded optimizer state of step STEP is written.

  python tests/programs/killed_zero_save.py STEP REPLICA MARKER zero_job-args...

The process that writes replica REPLICA's file of ``checkpoints/zero-STEP`` dies just before that write (the
files of its other replicas, and other processes' files, whole or not yet written): the first time only, as
MARKER (a file it creates) records, so a relaunched job trains on. The kill is real (SIGKILL: no handler, no
clean-up); only its moment is chosen here, since a kill timed from outside cannot hit a write of a small model.
"""

import os
import runpy
import signal
import sys

import tensorflow as tf

STEP, REPLICA, MARKER, ARGS = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
_save = tf.raw_ops.SaveV2


def _save_or_die(*, prefix, **kwargs):
    parent, name = os.path.split(str(prefix))
    if os.path.basename(parent) == f"zero-{STEP}" and name.startswith(f"replica-{REPLICA}-of-") \
            and not os.path.exists(MARKER):
        open(MARKER, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return _save(prefix=prefix, **kwargs)


tf.raw_ops.SaveV2 = _save_or_die
sys.argv = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "zero_job.py"), *ARGS]
runpy.run_path(sys.argv[0], run_name="__main__")
