"""The runtime's error family: every expected failure is a `KvcalibRuntimeError`.

Messages are one line that names the offending input and says how to fix it.
"""


class KvcalibRuntimeError(Exception):
    """Base class of every error the runtime raises on purpose (bad input, not a bug)."""

    def __str__(self) -> str:  # one line, even when it quotes a damaged file's text
        return " ".join(super().__str__().splitlines())


class FormatError(KvcalibRuntimeError):
    """A converted checkpoint does not follow FORMAT.md, or was changed after it was written."""


class CapacityError(KvcalibRuntimeError):
    """A request does not fit: prompt longer than the cache, cache larger than device memory."""
