"""Each layout declares its calibrated tensors (layouts.base.Calibrated); the side-car's name
table, KVParams' files and tensor-parallel sharding read the declaration instead of a list of
their own, so a layout's new tensor is named, stored, read back and sharded where it is
declared."""

from types import SimpleNamespace

import pytest
import torch

from kvcalib_runtime.cache.scheme import KVParams, KVScheme, LayerScheme
from kvcalib_runtime.cache.shard import shard_params
from kvcalib_runtime.checkpoint import params as side_car
from kvcalib_runtime.checkpoint.checks import check_params
from kvcalib_runtime.layouts import base, registered
from kvcalib_runtime.layouts.base import Calibrated, Layout, calibrated_tensors, register
from kvcalib_runtime.layouts.quant import QuantSpec

HKV, D = 4, 8
DECLARED = calibrated_tensors()


def test_every_registered_layout_declares_what_it_allocates_with():
    """The union is the three tensors the registered layouts take (allocate's keywords), and
    a spec's `calibrated` shapes are what its body is allocated from."""
    assert {c.argument for c in DECLARED.values()} == {"static_range", "codebook", "split"}
    assert set(registered()) >= {"static", "vq", "turboquant"}
    vq = QuantSpec(4, "static", 2, codebook=True, method="vq").layout
    assert vq.calibrated(HKV, D) == {
        "static_range": ((HKV, D), torch.float32),
        "codebook": ((HKV, 16, 2), torch.float32),
    }
    turbo = QuantSpec(2, symmetric=True, method="turboquant", split_channels=2, split_bits=4)
    assert turbo.layout.calibrated(HKV, D) == {"split": ((HKV, 2), torch.int64)}
    assert QuantSpec(2).layout.calibrated(HKV, D) == {}


def _params() -> KVParams:
    """Every declared tensor of layer 0, for keys and values, one row per head."""
    params = KVParams()
    for c in DECLARED.values():
        for kind in ("key", "value"):
            t = torch.arange(HKV * D, dtype=c.dtype).view(HKV, D)
            getattr(params, f"{kind}_{c.name}")[0] = (t, t + 1) if c.pair else t
    return params


@pytest.mark.parametrize("name", list(DECLARED))
def test_a_declared_tensor_is_named_stored_read_and_sharded(name):
    c, params = DECLARED[name], _params()
    tensors = params.tensors()
    ends = ("_lo", "_hi") if c.pair else ("",)
    names = [f"layers.0.{kind}_{name}{end}" for kind in ("key", "value") for end in ends]
    assert set(names) <= set(tensors)
    assert all(side_car.NAMES.fullmatch(n) for n in names)
    back = KVParams.from_tensors(tensors)
    for kind in ("key", "value"):
        ours, theirs = (getattr(p, f"{kind}_{name}")[0] for p in (params, back))
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    scheme = KVScheme((LayerScheme(None, None),))
    share = shard_params(scheme, params, kv_heads=HKV, rank=1, world=2)
    got = getattr(share, f"key_{name}")[0]
    want = getattr(params, f"key_{name}")[0]
    pairs = zip(got, want, strict=True) if c.pair else [(got, want)]
    assert all(torch.equal(a, b[2:]) for a, b in pairs)  # rank 1 of 2: heads 2 and 3


GAIN = Calibrated("gain", "gain", "[Hkv]", (1,), torch.float32)  # a kind no shipped layout has


class Gained(Layout):
    """A layout with a calibrated tensor of a new kind, declared here alone."""

    name = method = "gained"
    calibrates = (GAIN,)

    def calibrated(self, kv_heads: int, head_dim: int) -> dict[str, tuple]:
        return {GAIN.argument: ((kv_heads,), GAIN.dtype)}


@pytest.fixture
def gained():
    register(Gained)
    yield QuantSpec(4, symmetric=True, method="gained")
    base._BY_METHOD.pop("gained")


def test_a_new_kind_is_declared_once(gained):
    """KVParams stores, names and reads back a kind declared after import, and check_params asks
    for it where the layout does, with the shape it declares."""
    params = KVParams(key_gain={0: torch.ones(HKV)})
    params.value_gain[0] = torch.full((HKV,), 2.0)
    tensors = params.tensors()
    assert set(tensors) == {"layers.0.key_gain", "layers.0.value_gain"}
    assert torch.equal(KVParams.from_tensors(tensors).value_gain[0], tensors["layers.0.value_gain"])
    geo = SimpleNamespace(kv_heads=HKV, head_dim=D)  # what check_params reads of a model
    check_params(KVScheme((LayerScheme(gained, gained),)), params, geo)
    del params.value_gain[0]
    with pytest.raises(ValueError, match=r"layers\.0\.value_gain must have shape \(4,\)"):
        check_params(KVScheme((LayerScheme(gained, gained),)), params, geo)
    with pytest.raises(TypeError, match="'key_gains' is no declared calibrated tensor"):
        KVParams(key_gains={})
