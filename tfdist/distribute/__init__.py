"""The distribution layer: which strategy runs the job, and the one surface every backend presents.

`strategies` is the registry (a name -> the builder of its `backend.Backend`)
and `make_strategy`; `cluster` resolves TF_CONFIG/SLURM read-only; `backend`
is the surface the training loop talks to; `horovod_support`,
`parameter_server` and `tpu` are the backends that need more than a
tf.distribute strategy.
"""
