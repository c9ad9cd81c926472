"""``python -m etl.cli``: the same as the ``etl`` command (worker processes in tests run it so)."""

from etl.cli.app import main

main()
