"""The arguments of lm-eval's `kvcalib` model type (kvcalib.lmeval), parsed and checked in one
place, before any model loads: ARGS is the table (name, default, parser, what to use instead),
`parse_args` its one reader.

    parse_args({"pretrained": "smollm2-135m", "residual": "none", "device": "cpu"})

A --model_args entry is named NAME=VALUE in a refusal, one of lm-eval's own options (--device,
--batch_size, --max_batch_size, which lm-eval passes to every model type) by that option. An
unknown name gets "did you mean". lm-eval's parsers type the values ("128" -> 128, "-5" -> -5.0,
"None" -> None, other words stay text), so every parser takes any of those.
"""

import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass

from kvcalib.core import options
from kvcalib.errors import OptionError

RESIDUAL = 128  # the window every recipe is given by default, as in the project's tables


@dataclass(frozen=True)
class Arg:
    """One argument of the kvcalib model type. `parse(value)` turns what lm-eval hands over (its
    parsers type "NAME=VALUE" as a str, int, float, bool or None) into the value, or returns
    REFUSED for a value it refuses, and `use` says what to give instead. `option`: lm-eval's own
    option that passes it (--device, --batch_size), None for a --model_args entry."""

    name: str
    default: object
    parse: Callable[[object], object]
    use: str
    option: str | None = None

    def given(self, value) -> str:
        return f"{self.option} {value}" if self.option else f"{self.name}={value} (--model_args)"

    def value(self, value):
        parsed = self.parse(value)
        if parsed is REFUSED:
            raise OptionError(f"{self.given(value)}: {self.use}")
        return parsed


REFUSED = object()  # what a parser returns for a value it refuses


def _is_none(value) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() == "none")


def _integer(value) -> int | None:
    """An integer given as one, as a float without a fraction (lm-eval reads "-5" as -5.0) or
    as digits."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d{1,19}\s*", value):
        return int(value)
    return None


def _count(minimum: int, *, none: bool = False) -> Callable[[object], object]:
    def parse(value):
        if none and _is_none(value):
            return None
        n = _integer(value)
        return n if n is not None and minimum <= n <= options.MAX_COUNT else REFUSED

    return parse


def _text(value):
    """A name or a path (lm-eval reads a name of digits as a number: it is given back as text)."""
    if _is_none(value):
        return None
    ok = isinstance(value, str | int | float) and not isinstance(value, bool)
    return str(value).strip() if ok and str(value).strip() else REFUSED


def _flag(value):
    text = str(value).strip().lower()
    return value if isinstance(value, bool) else {"true": True, "false": False}.get(text, REFUSED)


ARGS = {
    a.name: a
    for a in (
        Arg("pretrained", None, _text, "use a kvcalib model spec or a folder"),
        Arg("recipe", None, _text, "use a preset name or a recipe TOML file"),
        Arg("profile", None, _text, "use a profile folder (kvcalib calibrate's output)"),
        Arg(
            "residual",
            RESIDUAL,
            _count(0, none=True),
            "use a token count >= 0, or none to keep each recipe's own window",
        ),
        Arg(
            "dtype",
            "float32",
            lambda v: v if isinstance(v, str) and v in options.DTYPES else REFUSED,
            f"use one of {', '.join(options.DTYPES)}",
        ),
        Arg(
            "max_length",
            None,
            _count(2, none=True),
            "use an integer >= 2, or none for the model's context",
        ),
        Arg("max_gen_toks", 256, _count(1), "use an integer >= 1"),
        Arg("trust_remote_code", False, _flag, "use true or false"),
        Arg(
            "device",
            "cpu",
            _text,
            "use cpu, cuda or cuda:N",
            option="--device",
        ),
        Arg(
            "batch_size",
            1,
            lambda v: 1 if _integer(v) == 1 else REFUSED,
            "the kvcalib model type runs one request at a time (each through its own cache); "
            "use --batch_size 1",
            option="--batch_size",
        ),
        Arg(
            "max_batch_size",
            None,
            lambda v: None if v is None else REFUSED,
            "the kvcalib model type runs one request at a time; drop --max_batch_size",
            option="--max_batch_size",
        ),
    )
}


def parse_args(given: dict) -> dict:
    """Every argument of the kvcalib model type (ARGS) from `given`, the --model_args entries
    and what lm-eval passes itself, parsed and checked; the defaults for the others."""
    for name in given:
        if name not in ARGS:
            mine = [a for a in ARGS if ARGS[a].option is None]
            close = difflib.get_close_matches(str(name), mine, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise OptionError(
                f"{name}={given[name]} (--model_args): the kvcalib model type has no argument "
                f"{name}; {hint}use {', '.join(mine)}"
            )
    return {n: a.value(given[n]) if n in given else a.default for n, a in ARGS.items()}


__all__ = ["ARGS", "RESIDUAL", "Arg", "parse_args"]
