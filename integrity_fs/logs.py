"""What the library's log records look like where the application configured no logging.

integrity_fs logs on the ``integrity_fs`` logger: checkpoints skipped and why, reads retried,
files left out. An application that configured logging (``logging.basicConfig``, a handler of its
own, pytest) gets them through its handlers, formatted its way. One that configured nothing used
to get them through ``logging.lastResort``, which prints the bare message: a ``skipping …`` line
with no level and no name, among the lines the program prints itself.

:class:`LastResort` takes ``logging.lastResort``'s place for this logger alone, and only where it
would have acted: a record at WARNING or above that no other handler on its way to the root would
handle. It prints ``integrity_fs: WARNING: skipping …`` on the current ``sys.stderr``. It configures
nothing: the root logger and every other logger stay as they are, any handler the application
adds (a ``NullHandler`` too) takes over, and ``logging.lastResort = None`` silences it as it
silences Python's own.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

__all__ = ["FORMAT", "LOGGER_NAME", "LastResort", "install"]

#: The logger every module of the library logs on.
LOGGER_NAME = "integrity_fs"
#: How :class:`LastResort` prints a record: ``integrity_fs: WARNING: message``.
FORMAT = "%(name)s: %(levelname)s: %(message)s"


class LastResort(logging.StreamHandler):  # type: ignore[type-arg]  # StreamHandler is generic in typeshed only
    """``logging.lastResort`` with the record's name and level, for the library's logger alone."""

    def __init__(self) -> None:
        logging.Handler.__init__(self, logging.WARNING)
        self.setFormatter(logging.Formatter(FORMAT))

    @property
    def stream(self) -> TextIO:  # always the stderr of the moment
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        """Ignored: the record goes to whatever ``sys.stderr`` is when it is emitted."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.lastResort is None or self._handled_elsewhere(record):
            return
        super().emit(record)

    def _handled_elsewhere(self, record: logging.LogRecord) -> bool:
        """Whether another handler will see ``record``: the same walk as ``Logger.callHandlers``."""
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(h is not self and record.levelno >= h.level for h in logger.handlers):
                return True
            if not logger.propagate:
                return False
            logger = logger.parent
        return False


def install() -> None:
    """Put one :class:`LastResort` on the library's logger (once, however often this runs)."""
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(handler, LastResort) for handler in logger.handlers):
        logger.addHandler(LastResort())
