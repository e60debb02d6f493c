"""Where each KV transform of a layer lives — in the weights, applied online, or nowhere — and
the one implementation of applying it. The simulator (kvcalib.sim), the transformers cache
adapter and the runtime cache all ask this module; none decides for itself.

A recipe quantizes keys and values in a *domain*: keys divided by smoothing scales s
(`KVParams.key_smooth[i]`, float [Hkv, D], equal on RoPE pairs), keys and queries
Hadamard-rotated after RoPE, values Hadamard-rotated per KV head (Q =
orthogonal_hadamard(D, seed)). Each transform of each layer has one placement:

    "none"    the domain does not have it and the weights do not contain it
    "fused"   the weights already produce the domain (kvcalib convert put it there)
    "online"  the weights do not contain it; the cache applies it on the way in and undoes it
              on the way out (simulation on the original weights, the runtime's key rotation)
    "undone"  the weights contain it but this cache's domain does not: the cache inverts it
              on the way in and re-applies it on the way out (a peer measured as on the
              original model, on kvcalib's converted weights)

Keys (per layer i, any side of RoPE: s commutes with it):
    into the domain:  online k / s,  undone k * s          (`key_in`)
    back out:         online k * s,  undone k / s          (`key_out`)
    queries meeting keys left in the domain: online q * s, undone q / s   (`query`)
Values:
    into the domain:  online v Q,  undone v Q^T            (`value_in`)
    back out (a value, or the attention output, which is linear in values): the inverse
                                                            (`value_out`)
The key rotation is online or none (it acts after RoPE and cannot be fused).
"""

from dataclasses import dataclass, replace

import torch

from kvcalib_runtime.checkpoint.closed import closed
from kvcalib_runtime.model.hadamard import hadamard_transform

NONE, FUSED, ONLINE, UNDONE = "none", "fused", "online", "undone"
PLACEMENTS = (NONE, FUSED, ONLINE, UNDONE)
KINDS = ("key_smooth", "value_rotation", "key_rotation")


@dataclass(frozen=True)
class LayerTransforms:
    """One layer's placements (see the module docstring)."""

    key_smooth: str = NONE
    value_rotation: str = NONE
    key_rotation: str = NONE

    def __post_init__(self):
        for kind in KINDS:
            if getattr(self, kind) not in PLACEMENTS:
                raise ValueError(f"{kind} = {getattr(self, kind)!r}: use one of {PLACEMENTS}")
        if self.key_rotation in (FUSED, UNDONE):
            raise ValueError("the key rotation acts after RoPE: it is online or none")

    @property
    def in_weights(self) -> frozenset[str]:
        """The transforms the weights contain."""
        return frozenset(k for k in KINDS if getattr(self, k) in (FUSED, UNDONE))


@dataclass(frozen=True)
class Transforms:
    """Every layer's placements, and the Hadamard sign seed of the rotations."""

    layers: tuple[LayerTransforms, ...]
    seed: int | None = None

    @classmethod
    def none(cls, num_layers: int) -> "Transforms":
        return cls((LayerTransforms(),) * num_layers)

    @classmethod
    def online(cls, scheme, params) -> "Transforms":
        """Every transform `scheme` and `params` quantize in, applied online: a cache on the
        original weights."""
        return cls.arrange(
            domain(scheme, params), [frozenset()] * len(scheme.layers), scheme.rotation_seed
        )

    @classmethod
    def arrange(
        cls, domain: list[frozenset[str]], weights: list[frozenset[str]], seed: int | None
    ) -> "Transforms":
        """Placements that take weights containing `weights[i]` to the domain `domain[i]`."""
        layers = []
        for want, have in zip(domain, weights, strict=True):
            place = {}
            for kind in KINDS:
                place[kind] = {
                    (False, False): NONE,
                    (True, True): FUSED,
                    (True, False): ONLINE,
                    (False, True): UNDONE,
                }[(kind in want, kind in have)]
            layers.append(LayerTransforms(**place))
        return cls(tuple(layers), seed)

    @classmethod
    def for_weights(cls, scheme, params, weights: "Transforms", weight_params):
        """(Transforms, KVParams) that run `scheme` with `params` on weights whose transforms
        are `weights` (a converted checkpoint's, with its calibrated `weight_params`): what the
        scheme quantizes in but the weights lack goes online, what the weights contain but the
        scheme does not is undone. ValueError when both hold a transform that differs (another
        rotation seed, other smoothing scales), which no placement can bridge."""
        have = [layer.in_weights for layer in weights.layers]
        want = domain(scheme, params)
        rotates = any("value_rotation" in h for h in have)
        if (
            rotates
            and scheme.rotation_seed != weights.seed
            and any(k in w for w in want for k in ("value_rotation", "key_rotation"))
        ):
            raise ValueError(
                f"the weights hold a value rotation of seed {weights.seed} and the recipe "
                f"rotates with seed {scheme.rotation_seed}: use the same rotation_seed"
            )
        smooth = dict(params.key_smooth)
        for i, (h, w) in enumerate(zip(have, want, strict=True)):
            if "key_smooth" not in h:
                continue
            theirs = weight_params.key_smooth[i]
            if "key_smooth" in w and not torch.equal(smooth[i], theirs):
                raise ValueError(
                    f"layer {i}: the weights hold other key smoothing scales than the recipe's"
                )
            smooth[i] = theirs
        seed = weights.seed if rotates else scheme.rotation_seed
        return cls.arrange(want, have, seed), replace(params, key_smooth=smooth)

    def fuse(self, kinds: set[str], layers: set[int] | None = None) -> "Transforms":
        """These placements with the online transforms of `kinds` moved into the weights (on
        `layers`, default all): what a conversion writes."""
        out = []
        for i, layer in enumerate(self.layers):
            changes = {
                k: FUSED
                for k in kinds
                if getattr(layer, k) == ONLINE and (layers is None or i in layers)
            }
            out.append(replace(layer, **changes))
        return Transforms(tuple(out), self.seed)

    # -- the side-car ------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "seed": self.seed,
            "layers": [{k: getattr(layer, k) for k in KINDS} for layer in self.layers],
        }

    @classmethod
    def from_json(cls, obj: dict) -> "Transforms":
        """ValueError (or TypeError) on anything but `to_json`'s shape, naming the path of an
        unknown or missing key."""
        closed(obj, ("seed", "layers"), "transforms", required=("seed", "layers"))
        layers = obj["layers"]
        if not isinstance(layers, list):
            raise ValueError("transforms.layers must be a list, one object per layer")
        where = "transforms.layers[{}]".format
        return cls(
            tuple(
                LayerTransforms(**closed(x, KINDS, where(i), required=KINDS))
                for i, x in enumerate(layers)
            ),
            obj["seed"],
        )

    # -- applying them -----------------------------------------------------------------------

    def key_scales(self, i: int, params) -> tuple[torch.Tensor | None, str]:
        """(s [Hkv, D], placement) of layer i's smoothing when the cache applies or undoes it
        online; (None, placement) otherwise."""
        place = self.layers[i].key_smooth
        if place in (ONLINE, UNDONE):
            s = params.key_smooth.get(i)
            if s is None:
                raise ValueError(f"layer {i}: key smoothing is {place}, but no scales were given")
            return s, place
        return None, place

    def key_in(self, i: int, k: torch.Tensor, params) -> torch.Tensor:
        """k [..., Hkv, T, D] into layer i's key domain."""
        s, place = self.key_scales(i, params)
        if s is None:
            return k
        s = s.to(k.device, k.dtype)[:, None, :]
        return k / s if place == ONLINE else k * s

    def key_out(self, i: int, k: torch.Tensor, params) -> torch.Tensor:
        """Inverse of `key_in`."""
        s, place = self.key_scales(i, params)
        if s is None:
            return k
        s = s.to(k.device, k.dtype)[:, None, :]
        return k * s if place == ONLINE else k / s

    def query(self, i: int, q: torch.Tensor, params) -> torch.Tensor:
        """q [B, H, T, D] post-RoPE, ready to meet keys kept in layer i's domain: smoothing
        (query head h uses KV head h // G) and the online key rotation."""
        s, place = self.key_scales(i, params)
        if s is not None:
            s = s.to(q.device, q.dtype).repeat_interleave(q.shape[1] // s.shape[0], 0)
            q = q * s[None, :, None, :] if place == ONLINE else q / s[None, :, None, :]
        if self.layers[i].key_rotation == ONLINE:
            q = hadamard_transform(q, seed=self.seed)
        return q

    def key_rotate(self, i: int, k: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
        """The online key rotation of layer i (after RoPE), or its inverse; identity when none."""
        if self.layers[i].key_rotation != ONLINE:
            return k
        return hadamard_transform(k, seed=self.seed, inverse=inverse)

    def value_in(self, i: int, v: torch.Tensor) -> torch.Tensor:
        """v [..., D] into layer i's value domain."""
        place = self.layers[i].value_rotation
        if place not in (ONLINE, UNDONE):
            return v
        return hadamard_transform(v, seed=self.seed, inverse=place == UNDONE)

    def value_out(self, i: int, v: torch.Tensor) -> torch.Tensor:
        """Inverse of `value_in`: for stored values, or an attention output over them."""
        place = self.layers[i].value_rotation
        if place not in (ONLINE, UNDONE):
            return v
        return hadamard_transform(v, seed=self.seed, inverse=place == ONLINE)


def domain(scheme, params) -> list[frozenset[str]]:
    """Per layer, the transforms a KVScheme (rotations) and its KVParams (smoothing scales)
    quantize in."""
    out = []
    for i, layer in enumerate(scheme.layers):
        kinds = {
            "key_smooth": i in params.key_smooth,
            "value_rotation": layer.value_rotation,
            "key_rotation": layer.key_rotation,
        }
        out.append(frozenset(k for k, on in kinds.items() if on))
    return out
