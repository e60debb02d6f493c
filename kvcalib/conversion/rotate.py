"""Function-preserving weight transforms, one decoder layer (a dict of tensors) at a time.

Each transform rewrites weights so that the model computes the same function, only with a
different basis inside (QuaRot, Ashkboos et al. 2024; SmoothQuant-style scaling, Xiao et al.
2023). Notation: a linear computes y = W x + b with W [out, in]; Q is orthonormal (Q Q^T = I)
and "x @ Q" is `hadamard_transform(x, seed=seed)` along the last dim.

  values     v' = v Q per KV head:      W_v,h <- Q^T W_v,h, b_v,h <- Q^T b_v,h;
             the attention output of every query head of group h comes out rotated, so
             W_o[:, head] <- W_o[:, head] Q.
  keys       k' = k / s, q' = q * s:    k_proj rows and bias / s, q_proj rows and bias * s (query
             head j uses KV head j // G); s equal on both members of each RoPE pair (j, j + D/2),
             so RoPE commutes and q'.k' = q.k. Qwen3 normalizes per head after the projection:
             there the scales go into k_norm / q_norm weights, which all heads share.
  residual   x' = x Q on the whole residual stream: RMSNorm(x Q) = RMSNorm(x) Q once its weight
             g is folded into the readers (W <- W diag(g), g <- 1); readers W <- W Q (q/k/v,
             gate/up, lm_head), writers W <- Q^T W, b <- Q^T b (o_proj, down_proj), E <- E Q.

Layer dicts are keyed by names relative to `model.layers.{i}.` (archs.py's names + ".weight").
Transforms compute in float32 (COMPUTE) and leave the result there; the caller casts.

Q is `orthogonal_hadamard(n, seed)`, applied by the runtime's `hadamard_transform` (one small
matmul per Kronecker factor of H_n) on CHUNK elements at a time, which bounds the temporaries of
a [vocab, hidden] matrix.
"""

import torch

from kvcalib_runtime import archs
from kvcalib_runtime.geometry import Geometry
from kvcalib_runtime.hadamard import hadamard_transform

COMPUTE = torch.float32
CHUNK = 1 << 22  # elements rotated at a time


def _right(x: torch.Tensor, seed: int | None, pre: torch.Tensor | None = None) -> torch.Tensor:
    """(x * pre) @ Q along the last dim, in COMPUTE precision, CHUNK elements at a time."""
    n = x.shape[-1]
    flat = x.reshape(-1, n)
    out = torch.empty(flat.shape, dtype=COMPUTE)
    rows = max(1, CHUNK // n)
    for i in range(0, flat.shape[0], rows):
        block = flat[i : i + rows].to(COMPUTE)
        out[i : i + rows] = hadamard_transform(block * pre if pre is not None else block, seed=seed)
    return out.reshape(x.shape)


def _left(w: torch.Tensor, seed: int | None) -> torch.Tensor:
    """Q^T W: rotate the output side of W [..., n, in]; a bias [n] becomes Q^T b = b @ Q."""
    if w.dim() == 1:
        return _right(w, seed)
    return _right(w.transpose(-1, -2).contiguous(), seed).transpose(-1, -2)


def _get(t: dict, name: str) -> torch.Tensor:
    return t[name].to(COMPUTE)


def rotate_values(t: dict, geo: Geometry, seed: int | None) -> None:
    """Fuse Q = orthogonal_hadamard(head_dim, seed) per KV head into v_proj and o_proj."""
    d = geo.head_dim
    for suffix in (".weight", ".bias"):
        name = archs.V_PROJ + suffix
        if name in t:
            v = _get(t, name)
            heads = v.view(geo.kv_heads, d, -1)  # [Hkv, D, hidden] or [Hkv, D, 1] for the bias
            t[name] = _left(heads, seed).reshape(v.shape)
    name = archs.O_PROJ + ".weight"
    o = _get(t, name)  # [hidden, H * D]: the columns of head j are j * D ... (j + 1) * D - 1
    t[name] = _right(o.view(o.shape[0], geo.heads, d), seed).reshape(o.shape)


def smooth_keys(t: dict, geo: Geometry, s: torch.Tensor, qk_norm: bool) -> None:
    """Divide keys by s [Hkv, D] and multiply queries by it (see the module docstring).

    With qk_norm, s must be the same for every KV head (`fusable_smoothing`).
    """
    s = s.to(COMPUTE)
    if qk_norm:
        t[archs.K_NORM + ".weight"] = _get(t, archs.K_NORM + ".weight") / s[0]
        t[archs.Q_NORM + ".weight"] = _get(t, archs.Q_NORM + ".weight") * s[0]
        return
    k_scale = s.reshape(-1)
    q_scale = s.repeat_interleave(geo.group, dim=0).reshape(-1)
    for proj, scale in ((archs.K_PROJ, 1 / k_scale), (archs.Q_PROJ, q_scale)):
        t[proj + ".weight"] = _get(t, proj + ".weight") * scale[:, None]
        if proj + ".bias" in t:
            t[proj + ".bias"] = _get(t, proj + ".bias") * scale


def check_smoothing(s: torch.Tensor, geo: Geometry) -> str | None:
    """Why s [Hkv, D] cannot be a key smoothing of this model, or None when it can."""
    if tuple(s.shape) != (geo.kv_heads, geo.head_dim):
        return f"shape {list(s.shape)}, expected [{geo.kv_heads}, {geo.head_dim}]"
    if not bool(torch.isfinite(s).all() and (s > 0).all()):
        return "scales must be finite and positive"
    half = geo.head_dim // 2
    if not torch.equal(s[:, :half], s[:, half:]):
        return "scales differ on a RoPE pair (channels j and j + head_dim/2)"
    return None


def fusable_smoothing(s: torch.Tensor, qk_norm: bool) -> bool:
    """Whether s can live in the weights: always, except per-head scales under a shared q/k norm."""
    return not qk_norm or bool(torch.equal(s, s[:1].expand_as(s)))


def rotate_residual(t: dict, seed: int) -> None:
    """One decoder layer's share of x' = x Q: fold norms into readers, rotate readers, writers."""
    for norm, readers in archs.READS_AFTER.items():
        g = _get(t, norm + ".weight")
        for reader in readers:
            t[reader + ".weight"] = _right(t[reader + ".weight"], seed, pre=g)
        t[norm + ".weight"] = torch.ones_like(g)
    for writer in archs.WRITES:
        for suffix in (".weight", ".bias"):
            if writer + suffix in t:
                t[writer + suffix] = _left(_get(t, writer + suffix), seed)


def rotate_embedding(e: torch.Tensor, seed: int) -> torch.Tensor:
    """E [vocab, hidden] -> E Q: the residual stream starts rotated."""
    return _right(e, seed)


def rotate_lm_head(w: torch.Tensor, norm: torch.Tensor, seed: int) -> torch.Tensor:
    """lm_head [vocab, hidden] -> W diag(g) Q, g the final norm's weight (then set to 1)."""
    return _right(w, seed, pre=norm.to(COMPUTE))
