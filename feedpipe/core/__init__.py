"""The core: everything between a source and a framework's devices, in no framework.

    source ──► sampler ──► producers ──► writer ──► slots/split ──► stage (a framework's Layer)
    what the   which       who makes     per-sample  which rows go    the protocol a framework
    samples    indices,    each batch:   work: read, where, in host   layer implements, and the
    are        what order  a thread or   transform,  memory laid out  host stager
               (remainder) workers       write       per replica
                                 stats observe every hop · state: the consumer's position

Plumbing: `pipeline` runs the background thread and `handoff` its queue; `_sync` is the one
stop/timeout/join pattern every thread and pool follows; `workers` holds the worker pools,
`_worker` what runs inside a worker, `_shm` the memory shared with them; `pinned` page-locks
slots for an accelerator's copy engine; `weights` keeps padding out of a Keras loss; `checks`
is the one rule, and wording, for a count a user passes.

Nothing here imports TensorFlow, JAX or Keras (a tf.data source imports TensorFlow in its own
methods, when given one).
"""
