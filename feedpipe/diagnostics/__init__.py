"""Is the accelerator starved, and what would help: `diagnosis` (`fp.diagnose`: `measure` runs
producer alone, step alone and both, `verdict` judges them, `remedies` ranks what would help),
`monitor` (`fp.StarvationMonitor`, a Keras callback), `report` (its HTML page), `_headspace`
(the step on pre-staged batches). Other processes' load is `feedpipe.core._contention`'s, which
`feedpipe.core.cost` reads too."""
