"""Random stored bits for the runtime's kernel tests: key-like data, codebooks, bodies filled
with random codes, metadata and slots, a body's buffers compared bit for bit, and all of it moved
to the GPU."""

import dataclasses

import torch

from kvcalib_runtime.layouts.packed_body import PackedBody
from kvcalib_runtime.layouts.vq import CodeBody

BODY = ("codes", "scale", "offset", "slot_index", "slot_delta")


def random_data(shape, gen, dtype=torch.float32):
    """Key-like data: channels of very different ranges and offsets, some huge outliers."""
    d = shape[-1]
    spread = torch.exp(torch.randn(d, generator=gen))
    x = torch.randn(shape, generator=gen) * spread + torch.randn(d, generator=gen)
    x.view(-1, d)[::7, 3] *= 20
    return x.to(dtype)


def random_codebook(spec, heads, gen):
    """Sorted levels in [0, 1] (asymmetric) or [-1, 1]; per head when `heads`, else per layer.
    Vector codes ("vq"): entries of group_size coordinates in [0, 1], [heads or 1, E, w]."""
    if spec.layout.vectors:
        return torch.rand(heads or 1, spec.levels, spec.group_size, generator=gen)
    lv = torch.rand(heads or 1, spec.levels, generator=gen).sort(-1).values
    lv = lv * 2 - 1 if spec.symmetric else lv
    return lv if heads else lv[0]


def random_body(spec, shape, dtype, gen, per_head_codebook=False):
    """A body of shape (B, Hkv, slots, D) filled with random bits: codes, positive scales,
    offsets, slots at random channels with random deltas (or exact values when spec is None)."""
    _b, h, _, d = shape
    if spec is None:
        return torch.randn(shape, generator=gen).to(dtype)
    static = None
    if spec.layout.calibrated_range:
        static = (-torch.rand(h, d, generator=gen) * 3, torch.rand(h, d, generator=gen) * 3)
    cb = random_codebook(spec, h if per_head_codebook else 0, gen) if spec.codebook else None
    body = spec.layout.allocate(shape, "cpu", dtype, static_range=static, codebook=cb)
    body.codes.copy_(torch.randint(0, 256, body.codes.shape, generator=gen))
    if spec.metadata_code == "byte":  # scales 0.25 to 1.75, any zero point
        body.scale.copy_(torch.randint(144, 167, body.scale.shape, generator=gen))
        if body.offset is not None:
            body.offset.copy_(torch.randint(0, 256, body.offset.shape, generator=gen))
    elif spec.granularity != "static":
        body.scale.copy_(torch.rand(body.scale.shape, generator=gen) * 0.8 + 0.2)
        if body.offset is not None:
            body.offset.copy_(-torch.rand(body.offset.shape, generator=gen))
    if getattr(body, "slot_index", None) is not None:
        width = spec.layout.width(d, h)  # a row's channels: every head's for "vector"
        body.slot_index.copy_(torch.randint(0, width, body.slot_index.shape, generator=gen))
        if spec.slot_code == "fp8":  # any E4M3 byte but NaN's: up to 448 steps either way
            code = torch.randint(0, 127, body.slot_delta.shape, generator=gen)
            sign = torch.randint(0, 2, body.slot_delta.shape, generator=gen) * 128
            body.slot_delta.copy_(code + sign)
        else:
            body.slot_delta.copy_(torch.randn(body.slot_delta.shape, generator=gen) * 10)
    return body


def assert_same_body(ours: PackedBody, ref: PackedBody):
    for name in BODY:
        a, b = getattr(ours, name), getattr(ref, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name


def tensors(value):
    """Every tensor in a value to_device accepts (fields of bodies, items of tuples), in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from tensors(getattr(value, f.name))
    elif isinstance(value, tuple | list):
        for v in value:
            yield from tensors(v)


def to_device(value, device="cuda"):
    """Tensors, bodies and (named) tuples of them with every tensor on `device`; a tensor already
    there stays itself (a view stays a view)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, PackedBody | CodeBody):
        fields = dataclasses.fields(value)
        return type(value)(**{f.name: to_device(getattr(value, f.name), device) for f in fields})
    if isinstance(value, tuple | list):
        items = [to_device(v, device) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value
