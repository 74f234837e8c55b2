"""``python -m lifecycle simulate ...``: the same command line as the ``lifecycle`` script."""

from lifecycle.cli import main

if __name__ == "__main__":  # importing it (as the docs build does) runs nothing
    raise SystemExit(main())
