"""The floating dtypes kvcalib loads and writes models in, by name or as torch dtypes.

Every public function takes either (dtype="bfloat16" or dtype=torch.bfloat16); `as_dtype`
turns what the caller gave into the torch dtype, at the edge.
"""

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def as_dtype(value: str | torch.dtype, error: type[Exception]) -> torch.dtype:
    """The torch dtype of a name in DTYPES or of one of its torch dtypes; else `error` naming
    the value and the choices."""
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    raise error(f"dtype {value!r}: use one of {', '.join(DTYPES)} (a name or the torch dtype)")


def name_of(dtype: torch.dtype) -> str:
    """ "float32" for torch.float32."""
    return str(dtype).removeprefix("torch.")
