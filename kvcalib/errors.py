"""kvcalib's error family: every expected failure raises a `KvcalibError` subclass.

The message is one line naming the offending input and the fix; the CLI prints it without a
traceback and exits 2. Anything else is a bug and keeps its traceback.
"""


class KvcalibError(Exception):
    """Base class of every error kvcalib raises on purpose."""

    def __str__(self) -> str:  # one line, even when it quotes a damaged file's text
        return " ".join(super().__str__().splitlines())


class ModelError(KvcalibError):
    """A model spec that cannot be resolved or loaded (missing, unsupported, unsafe)."""


class DataError(KvcalibError):
    """Text input that is missing, malformed or too short for the request."""


class RecipeError(KvcalibError):
    """A recipe with an unknown key, a wrong type or an impossible combination."""


class ProfileError(KvcalibError):
    """A calibration profile that is missing, of another model, or of another format version."""


class OutputError(KvcalibError):
    """An output folder that exists (without --force), overlaps an input or cannot be written."""


class OptionError(KvcalibError, ValueError):
    """An option out of its range (a count, a probability, a device, a dtype); a ValueError too,
    as Python callers expect of a bad argument."""


class NumericsError(KvcalibError):
    """NaN or Inf in activations, logits or scores."""
