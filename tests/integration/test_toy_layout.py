"""A new layout is one module (ARCHITECTURE.md, "Adding a layout"): this toy, defined and
registered here alone, runs through the registry, a cache's writer and flush, the reference
read, the memory walk and decoding, with no line of the runtime changed for it.

The toy ("toy" method): each row of a head is quantized symmetrically by its absmax to `bits`
bits, one code per byte, the row's scale in the cache's dtype. Its body is its own writer
(`packed` False), so the cache reads it through the reference path (`decoded` False), as it
reads TurboQuant's."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from support.tiny import tiny_model

from kvcalib.core.recipe import parse_recipe
from kvcalib.errors import RecipeError
from kvcalib.sim.simulate import Simulator
from kvcalib_runtime.cache.scheme import KVParams, KVScheme, LayerScheme
from kvcalib_runtime.layouts import base
from kvcalib_runtime.layouts.base import Kind, Layout, QTensor, register
from kvcalib_runtime.layouts.body import flush_by_write
from kvcalib_runtime.layouts.quant import QuantSpec, fake_quantize
from kvcalib_runtime.model.forward import Transformer
from kvcalib_runtime.model.transforms import Transforms

RTOL = 1e-5  # tests/integration/test_peer_caches.py's bound: decoding vs the one-pass simulation
T, PROMPT = 20, 7


@dataclass
class ToyBody:
    """codes uint8 [B, Hkv, N, D] (one code a byte), scale dtype [B, Hkv, N, 1]."""

    spec: QuantSpec
    codes: torch.Tensor
    scale: torch.Tensor
    kind: ClassVar[Kind] = Kind.TOKEN
    packed: ClassVar[bool] = False

    @property
    def slots(self) -> int:
        return self.codes.shape[2]

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scale]

    def view(self, b: int) -> "ToyBody":
        return ToyBody(self.spec, self.codes[b : b + 1], self.scale[b : b + 1])

    def write(self, x, seq, start, active=None) -> None:
        active = [True] * len(x) if active is None else active.tolist()
        for xm, b, s, on in zip(x, seq.tolist(), start.tolist(), active, strict=True):
            if on:
                q = self.spec.layout.quantize(xm)
                where = torch.arange(s, s + xm.shape[1], device=x.device) % self.slots
                self.codes[b, :, where], self.scale[b, :, where] = q.codes, q.scale

    flush = flush_by_write

    def dequantize(self, dtype, b=None, n=None, start=0) -> torch.Tensor:
        rows = slice(None) if b is None else slice(b, b + 1)
        n = self.slots if n is None else n
        q = QTensor(self.codes[rows, :, start:n], self.scale[rows, :, start:n], None)
        out = self.spec.layout.dequantize(q).to(dtype)
        return out if b is None else out[0]


class ToyRows(Layout):
    name = method = "toy"
    affine = False
    bits = (2, 3, 4, 5, 6, 8)

    def row_group(self, width: int) -> int:
        return width

    def slots(self, n: int) -> int:
        return 0

    def quantize(self, x, *, static_range=None, codebook=None, exclude=None, split=None):
        qmax = 2 ** (self.spec.bits - 1) - 1
        scale = (x.float().abs().amax(-1, keepdim=True) / qmax).to(x.dtype)
        s = torch.where(scale.float() > 0, scale.float(), 1.0)
        codes = (x.float() / s).round().clamp(-qmax, qmax) + qmax
        return QTensor(codes.to(torch.uint8), scale, None)

    def dequantize(self, q, *, codebook=None, split=None) -> torch.Tensor:
        qmax = 2 ** (self.spec.bits - 1) - 1
        return (q.codes.float() - qmax) * q.scale.float()

    def allocate(self, shape, device, dtype, *, static_range=None, codebook=None, split=None):
        b, hkv, n, d = shape
        codes = torch.zeros(b, hkv, n, d, device=device, dtype=torch.uint8)
        return ToyBody(self.spec, codes, torch.zeros(b, hkv, n, 1, device=device, dtype=dtype))


@pytest.fixture(scope="module")
def toy():
    """ToyRows registered for this module's tests, then removed from the registry."""
    register(ToyRows)
    yield QuantSpec(4, symmetric=True, method="toy")
    base._BY_METHOD.pop("toy")


def test_the_registry_binds_the_toy(toy):
    assert type(toy.layout) is ToyRows
    with pytest.raises(ValueError, match="bits = 7 is not supported"):
        QuantSpec(7, symmetric=True, method="toy")
    with pytest.raises(ValueError, match="own numerics"):  # Layout.check, inherited
        QuantSpec(4, method="toy")


def test_a_recipe_names_the_toy(toy):
    """The recipe's choices read the registry when a recipe is parsed: the toy, registered after
    import, is a method a recipe may name, and the spec it resolves to binds the toy."""
    doc = {"bits": 4, "method": "toy", "symmetric": True}
    recipe = parse_recipe({"name": "toy", "key": doc, "value": doc})
    assert recipe.key.spec() == toy
    with pytest.raises(RecipeError, match=r"'key\.method' = 'toys'; use one of .*, toy$"):
        parse_recipe({"name": "toy", "key": {**doc, "method": "toys"}})


VQ = QuantSpec(4, "static", 2, codebook=True, method="vq")


@pytest.mark.parametrize(
    ("spec", "paged"),
    [
        (QuantSpec(2, group_size=32), True),  # per-token groups
        (QuantSpec(4, "static"), True),
        (QuantSpec(3, granularity="vector"), True),
        (VQ, True),
        (QuantSpec(2, "channel", 32), False),  # metadata per group of tokens: no per-token row
        (QuantSpec(4, group_size=32, symmetric=True, method="ggml"), False),  # not decoded
        (QuantSpec(3, symmetric=True, method="turboquant"), False),
        (None, False),  # the toy: its own numerics, which the decode kernel does not read
    ],
)
def test_pages_hold_a_layout_by_its_body(toy, spec, paged):
    """What the vLLM plugin serves is read from the layout and its body (a row per token that
    the decode kernel reads), not listed by name: the layouts it served before, and the toy."""
    assert (spec or toy).layout.paged(3, 64) is paged


def test_write_and_reference_read_are_its_numerics(toy):
    """What a body stores and reads back is the layout's fake quantization, bit for bit, and
    its memory is what it allocated: 4-bit codes kept one a byte (8 bits) plus an fp16 scale per
    row of 64 channels (16 / 64)."""
    x = torch.randn(2, 3, 10, 64, generator=torch.Generator().manual_seed(0)).half()
    body = toy.layout.allocate((2, 3, 16, 64), "cpu", torch.float16)
    body.write(x, torch.tensor([1, 0]), torch.tensor([0, 5]))
    expected = fake_quantize(x, toy)
    assert torch.equal(body.dequantize(torch.float16, 1, 10), expected[0])
    assert torch.equal(body.dequantize(torch.float16)[0, :, 5:15], expected[1])
    assert toy.layout.bits_per_element(64, 16, kv_heads=3) == 8 + 16 / 64


@torch.no_grad()
def test_decoding_the_toy_equals_the_one_pass_simulation(toy, tmp_path):
    """Prefill, then a token at a time through the runtime cache (its writer, flush and
    reference read), against the simulator's fake quantization: test_peer_caches's bound, and
    away from full precision (the quantization is really there). The cache's warning that the
    decode kernel does not read it names the toy."""
    hf = tiny_model("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    hf.save_pretrained(tmp_path)
    model = Transformer.from_folder(tmp_path)
    n = hf.config.num_hidden_layers
    scheme = KVScheme(tuple(LayerScheme(toy, toy, key_flush=2) for _ in range(n)), residual=4)
    params = KVParams()
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(3))
    cache = model.new_cache(1, T, scheme, params, Transforms.online(scheme, params))
    out = [model(ids[:, :PROMPT], cache)]
    with pytest.warns(UserWarning, match="stores layout toy, whose own numerics"):  # by its name
        out = torch.cat(out + [model(ids[:, t : t + 1], cache) for t in range(PROMPT, T)], 1)
    simulated = Simulator(hf, scheme, params, mode="decode", prefill=PROMPT)(ids)
    full = hf(ids).logits

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    assert rel(out, simulated) < RTOL
    assert rel(simulated, full) > 1e-3
