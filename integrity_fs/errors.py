"""The exceptions integrity_fs raises, one root per failure family.

- content does not match the manifest: :class:`IntegrityError` (carries the full report);
- no manifest at all: :class:`ManifestNotFoundError` (a ``FileNotFoundError``);
- the manifest cannot be trusted as a description: :class:`ManifestError` (a ``ValueError``);
- a signature is missing, invalid, or covers other digests: :class:`SignatureError` (an
  ``IntegrityError``);
- a load that failed part-way left data in ``state_dict``: :class:`PartialLoadError` (an
  ``IntegrityError``);
- a file changed while it was read: :class:`FileChangedError` (an ``OSError``);
- storage failed: a built-in ``OSError``, never one of the above.
"""

from __future__ import annotations

from collections.abc import Sequence

from .report import SIGNATURE_FILENAME, Problem, Report, shortened

__all__ = [
    "CheckpointingException",
    "FileChangedError",
    "IntegrityError",
    "ManifestError",
    "ManifestNotFoundError",
    "PartialLoadError",
    "SignatureError",
]

_MAX_NAMED = 10


class IntegrityError(Exception):
    """The checkpoint's content does not match its manifest.

    ``report`` holds every problem found; the message names each bad file (the first
    ten, then a count).
    """

    def __init__(self, report: Report, location: str = "") -> None:
        self.report = report
        self.location = location
        super().__init__(self._describe())

    def _describe(self) -> str:
        problems = self.report.problems
        where = f" at {self.location}" if self.location else ""
        noun = "problem" if len(problems) == 1 else "problems"
        named = shortened([str(p) for p in problems], _MAX_NAMED, sep="; ")
        return f"checkpoint{where} failed verification, {len(problems)} {noun}: {named}"

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.report, self.location))


class SignatureError(IntegrityError):
    """A signature check failed: ``model.sig`` is missing or invalid for the given key, or the
    digests it covers differ from the manifest's.

    ``detail`` says what failed. ``report`` names what differs: per file (``"extra"``: signed but
    not in the manifest; ``"missing"``: in the manifest but not signed; ``"mismatch"``: signed
    with other digests) or, when the signature itself failed, ``model.sig``.
    """

    def __init__(self, detail: str, report: Report | None = None, location: str = "") -> None:
        if report is None:
            report = Report(problems=(Problem(SIGNATURE_FILENAME, "mismatch"),))
        self.detail = detail
        super().__init__(report, location)

    def _describe(self) -> str:
        where = f" at {self.location}" if self.location else ""
        return f"signature check{where} failed: {self.detail}"

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.detail, self.report, self.location))


class PartialLoadError(IntegrityError):
    """A load failed after verified bytes of the checkpoint had reached ``state_dict``, and no
    checkpoint loaded over them: ``state_dict`` holds partial data (``dcp.load_latest``).

    ``detail`` names the checkpoints whose data is left and why each load failed; ``report`` and
    ``location`` are those of the first one's damage (an empty report when it failed otherwise).
    """

    def __init__(self, detail: str, report: Report | None = None, location: str = "") -> None:
        self.detail = detail
        super().__init__(report if report is not None else Report(), location)

    def _describe(self) -> str:
        return self.detail

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.detail, self.report, self.location))


#: The seed's name for :class:`IntegrityError`, kept so seed-era ``except`` clauses still work.
CheckpointingException = IntegrityError


class ManifestNotFoundError(FileNotFoundError):
    """There is no manifest where one was expected."""


class ManifestError(ValueError):
    """The manifest is unreadable or invalid; the message says what is wrong."""


class FileChangedError(OSError):
    """A file's version changed while an operation read it: written to, replaced or cut since the
    listing the operation works from. Not damage, and never an OK: run again once writers are done.

    ``names`` are the files (as the message names them).
    """

    def __init__(self, message: str, names: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.names = tuple(names)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.names))
