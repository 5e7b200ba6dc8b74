"""The ``integrity-fs`` command (also ``python -m integrity_fs``): ``main(argv) -> exit code``.
The library never imports this package."""

from .main import main

__all__ = ["main"]
