"""The ``etl`` command: ``app`` holds run/replay/status/db/dlq, ``quality`` the quality commands."""

from etl.cli.app import app, main

__all__ = ["app", "main"]
