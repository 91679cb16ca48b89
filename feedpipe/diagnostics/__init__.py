"""Is the accelerator starved, and what would help: `diagnosis` (`fp.diagnose`: producer alone,
step alone, both), `monitor` (`fp.StarvationMonitor`, a Keras callback), `report` (its HTML
page), `_headspace` (the step on pre-staged batches), `_contention` (other processes' load)."""
