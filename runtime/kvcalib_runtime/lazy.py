"""Public names that load on first use, so importing a package stays cheap (no torch, no
triton) until something is actually used."""

import importlib
import sys


def lazy(package: str, modules: dict[str, tuple[str, ...]]):
    """(__getattr__, __dir__, __all__) for `package`, whose public names modules[m] live in
    module m."""
    table = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str):
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted([*vars(sys.modules[package]), *table])

    return __getattr__, __dir__, sorted(table)
