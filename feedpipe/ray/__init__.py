"""Per-sample work on a Ray cluster (`service="ray"`): `cluster` connects and puts the work in
the object store once, `tasks` is what runs in Ray's worker processes, `producer` fills the
feeder's slots from their answers in the feeder's order."""
