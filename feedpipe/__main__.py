"""`python -m feedpipe`: the same as the `feedpipe` command."""

from feedpipe.cli import main

raise SystemExit(main())
