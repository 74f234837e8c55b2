"""``python -m lifecycle simulate ...``: the same command line as the ``lifecycle`` script."""

from lifecycle.cli import main

raise SystemExit(main())
