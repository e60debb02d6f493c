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
             so RoPE commutes and q'.k' = q.k. Qwen3 and Gemma 3 normalize per head after the
             projection: there the scales go into the k_norm / q_norm weights, which all heads
             share (Gemma's norm multiplies by 1 + w: w <- (1 + w) / s - 1 for keys).
  residual   x' = x Q on the whole residual stream: RMSNorm(x Q) = RMSNorm(x) Q once its weight
             g is folded into the readers (W <- W diag(g), g <- 1); readers W <- W Q (q/k/v,
             gate/up, lm_head), writers W <- Q^T W, b <- Q^T b (o_proj, down_proj), E <- E Q.
             Gemma's norms after attention and MLP scale channels of the writers' output before
             it joins the stream, which no rotation passes: convert refuses it there.

phi3 keeps q/k/v as row blocks [q; k; v] of one `qkv_proj` and gate/up as [gate; up] of one
`gate_up_proj`: the transforms act on those rows in place (a row block of a linear is the linear
of that block), and the residual rotation treats each fused matrix as one reader.

Layer dicts are keyed by names relative to `model.layers.{i}.` (archs.py's names + ".weight").
Transforms compute in float32 (COMPUTE) and leave the result there; the caller casts. They never
write into a tensor they are given (it maps the source file): every result is a new tensor, and
the converter copies one that comes back as the same object byte for byte from the source.

Q is `orthogonal_hadamard(n, seed)`, applied by the runtime's `rotate_columns` (Walsh-Hadamard
butterflies, O(n log n) per vector) on CHUNK elements at a time: 1 MiB of float32 and its
temporaries stay in cache, and a [vocab, hidden] matrix never has a full-size temporary.
"""

import math

import torch

from kvcalib_runtime.model import archs
from kvcalib_runtime.model.geometry import Geometry
from kvcalib_runtime.model.hadamard import rotate_columns

COMPUTE = torch.float32
CHUNK = 1 << 18  # elements rotated at a time


def _right(x: torch.Tensor, seed: int | None, pre: torch.Tensor | None = None) -> torch.Tensor:
    """(x * pre) @ Q along the last dim, in COMPUTE precision, CHUNK elements at a time (each
    row block's transpose is rotated as columns)."""
    n = x.shape[-1]
    flat = x.reshape(-1, n)
    out = torch.empty(flat.shape, dtype=COMPUTE)
    rows = max(1, CHUNK // n)
    for i in range(0, flat.shape[0], rows):
        block = flat[i : i + rows]
        block = block * pre if pre is not None else block
        out[i : i + rows] = rotate_columns(block.mT, seed=seed).mT
    return out.reshape(x.shape)


def _left(w: torch.Tensor, seed: int | None) -> torch.Tensor:
    """Q^T W: rotate the output side of W [..., n, in], CHUNK elements (whole columns) at a
    time; a bias [n] becomes Q^T b = b @ Q."""
    if w.dim() == 1:
        return _right(w, seed)
    out = torch.empty(w.shape, dtype=COMPUTE)
    cols = max(1, CHUNK // max(1, math.prod(w.shape[:-1])))
    for j in range(0, w.shape[-1], cols):
        out[..., j : j + cols] = rotate_columns(w[..., j : j + cols], seed=seed)
    return out


def _get(t: dict, name: str) -> torch.Tensor:
    """A new COMPUTE copy of t[name], to write into."""
    return t[name].to(COMPUTE, copy=True)


def _rows(geo: Geometry, which: str) -> tuple[str, slice]:
    """(linear, rows) that compute the queries, keys or values ("q", "k", "v") of a layer."""
    q, kv = geo.heads * geo.head_dim, geo.kv_heads * geo.head_dim
    if geo.arch.fused:
        start = {"q": 0, "k": q, "v": q + kv}[which]
        return archs.QKV_PROJ, slice(start, start + (q if which == "q" else kv))
    name = {"q": archs.Q_PROJ, "k": archs.K_PROJ, "v": archs.V_PROJ}[which]
    return name, slice(None)


def _update_rows(t: dict, geo: Geometry, which: str, fn) -> None:
    """Replace the weight rows (and bias) of q, k or v by fn(rows) (fp32, [n, in] or [n])."""
    name, rows = _rows(geo, which)
    for suffix in (".weight", ".bias"):
        if name + suffix in t:
            w = _get(t, name + suffix)
            w[rows] = fn(w[rows])
            t[name + suffix] = w


def rotate_values(t: dict, geo: Geometry, seed: int | None) -> None:
    """Fuse Q = orthogonal_hadamard(head_dim, seed) per KV head into the value rows and o_proj."""
    d = geo.head_dim

    def rotate(v):  # [Hkv * D, hidden] or [Hkv * D] for the bias
        heads = v.reshape(geo.kv_heads, d, -1)
        return _left(heads, seed).reshape(v.shape)

    _update_rows(t, geo, "v", rotate)
    name = archs.O_PROJ + ".weight"
    o = t[name]  # [hidden, H * D]: the columns of head j are j * D ... (j + 1) * D - 1
    t[name] = _right(o.view(o.shape[0], geo.heads, d), seed).reshape(o.shape)


def smooth_keys(t: dict, geo: Geometry, s: torch.Tensor) -> None:
    """Divide keys by s [Hkv, D] and multiply queries by it (see the module docstring).

    With a q/k norm, s must be the same for every KV head (`fusable_smoothing`).
    """
    s = s.to(COMPUTE)
    arch = geo.arch
    if arch.qk_norm:
        k, q = _get(t, archs.K_NORM + ".weight"), _get(t, archs.Q_NORM + ".weight")
        if arch.gemma:  # the norms multiply by 1 + w
            t[archs.K_NORM + ".weight"] = (1 + k) / s[0] - 1
            t[archs.Q_NORM + ".weight"] = (1 + q) * s[0] - 1
        else:
            t[archs.K_NORM + ".weight"], t[archs.Q_NORM + ".weight"] = k / s[0], q * s[0]
        return
    k_scale = s.reshape(-1)
    q_scale = s.repeat_interleave(geo.group, dim=0).reshape(-1)
    for which, scale in (("k", 1 / k_scale), ("q", q_scale)):
        _update_rows(t, geo, which, lambda w, scale=scale: w * scale.view(-1, *[1] * (w.dim() - 1)))


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


def rotate_residual(t: dict, geo: Geometry, seed: int) -> None:
    """One decoder layer's share of x' = x Q: fold norms into readers, rotate readers, writers."""
    assert not geo.arch.post_norms, "a residual rotation cannot pass norms after the writers"
    for norm, readers in geo.arch.reads_after.items():
        g = _get(t, norm + ".weight")
        for reader in readers:
            t[reader + ".weight"] = _right(t[reader + ".weight"], seed, pre=g)
        t[norm + ".weight"] = torch.ones_like(g)
    for writer in archs.WRITES:
        for suffix in (".weight", ".bias"):
            if writer + suffix in t:
                t[writer + suffix] = _left(t[writer + suffix], seed)


def rotate_embedding(e: torch.Tensor, seed: int) -> torch.Tensor:
    """E [vocab, hidden] -> E Q: the residual stream starts rotated."""
    return _right(e, seed)


def rotate_lm_head(w: torch.Tensor, norm: torch.Tensor, seed: int) -> torch.Tensor:
    """lm_head [vocab, hidden] -> W diag(g) Q, g the final norm's weight (then set to 1)."""
    return _right(w, seed, pre=norm.to(COMPUTE))
