"""Every call feedpipe makes into a framework's private APIs, one module per framework: `tf`
(TensorFlow, tf.data and its service), `keras` (Keras 3's data adapters, trainers and losses,
and what `fit` keeps in its frames), `jax` and `torch`.

Each call is here because no public API does the job (the reason is beside it), so a new
release of a framework is checked against its module alone. A module imports its framework
inside its functions: worker processes import modules that use these and never load one, and
importing one module imports no framework. No module outside this package imports
`keras.src`, `tensorflow.python` or `jax._src`, or reads a framework's frames (a test checks
both).
"""
