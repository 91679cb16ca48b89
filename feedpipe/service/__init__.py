"""tf.data service as feedpipe's per-sample workers: `client` asks a dispatcher for the rows
of the steps ahead and writes them into slots, exactly once; `servers` starts TensorFlow's own
dispatcher and worker servers (`feedpipe service ...`)."""
