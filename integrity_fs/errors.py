"""The exceptions, one root per failure family. A storage failure is a built-in ``OSError``,
never one of these content errors."""

from __future__ import annotations

from collections.abc import Sequence

from .report import Problem, Report, shortened

__all__ = [
    "CheckpointingException",
    "FileChangedError",
    "IntegrityError",
    "ManifestError",
    "ManifestNotFoundError",
    "PartialLoadError",
    "SignatureError",
]


class IntegrityError(Exception):
    """The content does not match the manifest; ``report`` holds every problem, the message names
    the first ten."""

    def __init__(self, report: Report, location: str = "") -> None:
        self.report = report
        self.location = location
        super().__init__(self._describe())

    def _describe(self) -> str:
        problems = self.report.problems
        where = f" at {self.location}" if self.location else ""
        noun = "problem" if len(problems) == 1 else "problems"
        return f"checkpoint{where} failed verification, {len(problems)} {noun}: " + shortened(
            [str(p) for p in problems], 10, sep="; "
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.report, self.location))


class _Detailed(IntegrityError):
    """An ``IntegrityError`` whose message is ``detail``."""

    def __init__(self, detail: str, report: Report | None = None, location: str = "") -> None:
        self.detail = detail
        super().__init__(report if report is not None else self._default_report(), location)

    def _default_report(self) -> Report:
        return Report()

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.detail, self.report, self.location))


class SignatureError(_Detailed):
    """``model.sig`` is missing or invalid for the key, or covers other digests than the manifest's;
    ``report`` names what differs."""

    def _default_report(self) -> Report:
        return Report(problems=(Problem("model.sig", "mismatch"),))

    def _describe(self) -> str:
        where = f" at {self.location}" if self.location else ""
        return f"signature check{where} failed: {self.detail}"


class PartialLoadError(_Detailed):
    """A load failed after verified bytes had reached ``state_dict`` and nothing loaded over them."""

    def _describe(self) -> str:
        return self.detail


#: The seed's name for :class:`IntegrityError`.
CheckpointingException = IntegrityError


class ManifestNotFoundError(FileNotFoundError):
    """There is no manifest where one was expected."""


class ManifestError(ValueError):
    """The manifest is unreadable or invalid."""


class FileChangedError(OSError):
    """A file changed (rewritten, replaced, deleted) while an operation read it: not damage, and
    never an OK. ``names``: the files."""

    def __init__(self, message: str, names: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.names = tuple(names)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.names))
