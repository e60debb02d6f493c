"""Hypothesis strategies that damage a valid document, for fuzzing the readers of untrusted
files (side-cars, recipes, safetensors headers): each reader must either accept the damaged
document or raise its own documented error - never another exception, never a hang.

    mutated(obj)          a JSON-like dict/list with 1-3 edits: a key dropped, a value replaced
                          by one of any type, an unknown key added
    mutated_bytes(data)   bytes with 1-4 edits: a bit flipped, a cut, bytes inserted or deleted
"""

import copy

from hypothesis import strategies as st

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, 1, -1, 2, 16, 2**31, 2**63])  # the boundaries, drawn often
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


def _paths(obj, prefix=()):
    """Every path (a tuple of keys and indices) into a nest of dicts and lists."""
    yield prefix
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    )
    for k, v in items:
        yield from _paths(v, (*prefix, k))


@st.composite
def mutated(draw, obj, values=JSON_VALUES):
    """A deep copy of `obj` with 1-3 structural edits."""
    obj = copy.deepcopy(obj)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(_paths(obj))))
        if not path:  # the whole document
            if draw(st.booleans()):
                return draw(values)
            continue
        parent = obj
        for k in path[:-1]:
            parent = parent[k]
        op = draw(st.sampled_from(["drop", "replace", "add"]))
        if op == "drop":
            del parent[path[-1]]
        elif op == "replace":
            parent[path[-1]] = draw(values)
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=10))] = draw(values)
        else:
            parent.insert(path[-1], draw(values))
    return obj


@st.composite
def mutated_bytes(draw, data: bytes, within: int | None = None):
    """`data` with 1-4 byte edits, at positions below `within` (default: anywhere)."""
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            break
        i = draw(st.integers(0, min(len(data), within or len(data)) - 1))
        op = draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        if op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[i : i + draw(st.integers(1, 8))]
    return bytes(data)
