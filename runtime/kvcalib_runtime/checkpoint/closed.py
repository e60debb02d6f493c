"""Closed JSON objects: every object of the side-car has a fixed set of keys, and a reader
refuses any other, naming the key by its path (`scheme.layers[3].key.bitz`)."""


def closed(obj, known, where: str, required=()) -> dict:
    """obj, once it is a JSON object whose keys are all in `known` and include every one of
    `required`; ValueError naming `where` (the object's path) and the first key that is not."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where} must be an object, not {type(obj).__name__}")
    if extra := sorted(set(obj) - set(known), key=str):
        raise ValueError(
            f"{where}: unknown key {where}.{extra[0]} (known: {', '.join(sorted(known))})"
        )
    if missing := [k for k in required if k not in obj]:
        raise ValueError(f"{where}: missing key {where}.{missing[0]}")
    return obj
