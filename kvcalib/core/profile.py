"""Calibration profiles: the folder `kvcalib calibrate` writes, and the API that reads it.

    profile = Profile.load("profile/")
    profile.check_model(source)        # ProfileError when calibrated on another model
    lo, hi = profile.range("key", 3, position="pre_rope", outliers=0.01)   # float32 [Hkv, D]

A profile folder holds profile.safetensors, profile.json and report.html with its PNG plots.
Shapes: L layers, H query heads, Hkv KV heads, D head_dim, E hidden size, N windows of T tokens.

profile.safetensors (float32 unless noted):

  windows.input_ids                  int64 [N, T]     the calibration windows
  {kind}.{scope}.{stat}              [L, Hkv, D]      kind: key_pre_rope (k_proj output, after
                                                      k_norm where present), key_post_rope,
                                                      value; scope: all | nonsink (tokens not
                                                      flagged as sinks); stat: min, max,
                                                      absmax, mean, std
  {kind}.{scope}.quantiles           [L, Hkv, D, 14]  exact, at json "quantile_levels"
  key_pre_rope.range_ratio,
  key_post_rope.range_ratio          [L, Hkv, D]      non-sink channel range / head median range
  attention.received                 [L, H, T]        mean weight each key position receives
                                                      from the queries that see it (mean over
                                                      windows)
  attention.token0                   [L, H]           the same at position 0
  sinks.flags                        uint8 [N, T]     ground-truth attention sinks (1)
  sinks.layers                       int32 [N, T]     layers in which the position is a sink
  sinks.weight                       [N, T]           max over layers of its head-mean weight
                                                      from distant queries
  sinks.judged                       uint8 [T]        positions with enough distant queries
  sinks.token0                       [L]              fraction of windows with token 0 a sink
  massive.max_abs                    [L, E]           max |h| per residual dim after each layer
  massive.median_abs                 [L]              median |h| after each layer
  position_error.key                 [2, L, T]        mean ||k_hat - k|| / ||k|| per position,
                                                      per-token asymmetric 2 / 4 bit, post-RoPE
  position_error.key_groups          [2, L, 3]        the same on token 0, on later sinks (NaN
                                                      if none) and on non-sink tokens
  sensitivity.key, sensitivity.value [L, len(bits)]   KL at json "probe.bits" (2, 3, 4, 8),
                                                      estimated (Fisher) or measured (probe)
  sensitivity.answer.key, .value     [L, len(bits)]   per answer token of retrieval prompts
                                                      (json "probe.answer"): the increase in
                                                      its NLL, measured (method "probe"), or
                                                      the Fisher estimate of the KL ("fisher")
  codebook.{variant}.{bits}          [L, 2**bits]     sorted levels in [0, 1], or [-1, 1] for
                                                      ":symmetric" variants (phase codebooks)
  vqbook.{variant}.{bits}            [L, Hc, 2**bits, w]  entries of vectors of w channels
                                                      ("vq", calibration.vectorbooks; Hc 1 or
                                                      Hkv; phase codebooks)

profile.json: format_version; model {spec, path, fingerprint, model_type, num_layers,
num_heads, num_kv_heads, head_dim, hidden_size}; data; num_samples, seq_len, seed, device,
dtype, sequential (true: calibrated layer by layer, the same tensors), phases; versions
{python, torch, transformers, kvcalib}; settings; quantile_levels,
outlier_fractions; tokens {all, nonsink}; probe (the sensitivity's method, quantizers and bits,
or null); codebooks
{variants, bits, windows, bins} or null; timings (seconds per phase); layers (per layer:
token0_attention per head, token0_sink, key_outlier_channels_pre_rope and _post_rope per KV
head as [channel, ratio], massive_dims as [dim, max |h|, ratio to median], massive_tokens as
[text, count]); sinks {definition, token0_windows, token0_layers, windows, count, positions,
tokens}; massive {ratio, first_layer}; sink_predictor {layer, dims, threshold, precision,
recall, f1, held_out} or null; tensors_sha256 (the sha256 of profile.safetensors, binding the two
files; checked by `load`).
"""

import json
import math
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kvcalib.core import profile_check
from kvcalib.errors import ProfileError
from kvcalib.io import atomic
from kvcalib_runtime.cache.scheme import KEY_POSITIONS, SinkPredictor
from kvcalib_runtime.checkpoint.format import sha256_file

FORMAT_VERSION = 1
TENSORS = "profile.safetensors"
META = "profile.json"
QUANTILE_LEVELS = (
    0.0,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.975,
    0.99,
    0.995,
    0.9975,
    0.999,
    0.9995,
    1.0,
)
# Outlier fraction f excludes f/2 at each end: lo = quantile(f/2), hi = quantile(1 - f/2).
OUTLIER_FRACTIONS = (0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05)
# the losses a per-layer sensitivity is measured on, and the tensors holding each
_SENSITIVITY = {"text": "sensitivity", "answer": "sensitivity.answer"}
SENSITIVITY_LOSSES = tuple(_SENSITIVITY)


def select_range(quantiles: torch.Tensor, fraction: float):
    """(lo, hi) = quantiles at (f/2, 1 - f/2): quantiles [..., len(QUANTILE_LEVELS)] -> two
    [...] tensors; None when the outlier fraction is not one of OUTLIER_FRACTIONS."""
    for i, f in enumerate(OUTLIER_FRACTIONS):
        if math.isclose(fraction, f, rel_tol=1e-9, abs_tol=1e-12):
            hi = len(QUANTILE_LEVELS) - 1 - i
            return quantiles[..., i].contiguous(), quantiles[..., hi].contiguous()
    return None


class Profile:
    """A calibration profile: `meta` (the profile.json dict) and its named tensors."""

    FORMAT_VERSION = FORMAT_VERSION

    def __init__(self, meta: dict, tensors: dict[str, torch.Tensor], path: Path | None = None):
        self.meta = meta
        self.tensors = tensors
        self.path = Path(path) if path is not None else None

    # -- files ---------------------------------------------------------------------------------

    @classmethod
    def load(cls, path, source=None) -> "Profile":
        """Read and check a profile folder (kvcalib.core.profile_check): ProfileError naming
        the file and the field. With `source` (a ModelSource), a profile of another model is
        refused first, before its contents are judged."""
        path = Path(path)
        fix = f"create it with kvcalib calibrate [MODEL] -o {path}"
        if path.exists() and not path.is_dir():
            raise ProfileError(
                f"profile {path}: a file, not a profile folder; pass the folder kvcalib "
                "calibrate wrote (the one holding profile.json)"
            )
        if not path.is_dir():
            raise ProfileError(f"profile {path}: no such folder; {fix}")
        for name in (META, TENSORS):
            if (path / name).exists() and not (path / name).is_file():  # a FIFO: no hang
                raise ProfileError(f"profile {path}: {name} is not a regular file; {fix} --force")
            if not (path / name).is_file():
                raise ProfileError(f"profile {path}: {name} is missing; {fix} --force")
        try:
            meta = json.loads((path / META).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise ProfileError(
                f"profile {path}: {META} is not valid JSON ({e}); {fix} --force"
            ) from None
        meta = meta if isinstance(meta, dict) else {}
        model = meta.get("model") if isinstance(meta.get("model"), dict) else {}
        version = meta.get("format_version")
        if version != FORMAT_VERSION:
            spec = model.get("spec", "MODEL")
            raise ProfileError(
                f"profile {path} has format version {version}; this kvcalib reads "
                f"{FORMAT_VERSION}: recalibrate with kvcalib calibrate {spec} -o {path} --force"
            )
        if not all(isinstance(model.get(k), str) for k in ("spec", "fingerprint")):
            raise ProfileError(
                f"profile {path}: {META} lacks model.spec or .fingerprint; {fix} --force"
            )
        if source is not None:
            cls(meta, {}, path).check_model(source)
        try:
            tensors = load_file(path / TENSORS)
        except (SafetensorError, OSError) as e:
            raise ProfileError(
                f"profile {path}: {TENSORS} is unreadable ({e}); {fix} --force"
            ) from None
        profile_check.check(
            meta,
            tensors,
            str(path),
            quantile_levels=QUANTILE_LEVELS,
            outlier_fractions=OUTLIER_FRACTIONS,
        )
        bound = meta.get("tensors_sha256")
        if bound is not None and bound != sha256_file(path / TENSORS):
            raise ProfileError(
                f"profile {path}: {TENSORS} is not the one {META} was written with (its sha256 "
                f"differs from tensors_sha256: another calibration's?); {fix} --force"
            )
        return cls(meta, tensors, path)

    def save(self, path, *, force: bool = False) -> Path:
        """Write profile.json and profile.safetensors into the folder `path`, atomically."""
        path = Path(path)
        atomic.check_output(path, force, [], kind="profile")
        with atomic.staging(path, force) as tmp:
            self.write(tmp)
        self.path = path
        return path

    def write(self, folder: Path) -> None:
        """The two profile files into an existing folder (see `save` for the atomic write)."""

        tensors = {k: v.contiguous() for k, v in sorted(self.tensors.items())}
        save_file(tensors, folder / TENSORS, metadata={"format": "pt"})
        self.meta["tensors_sha256"] = sha256_file(folder / TENSORS)  # binds the two files
        (folder / META).write_text(json.dumps(self.meta, indent=1, ensure_ascii=False))

    # -- provenance ----------------------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        return self.meta["model"]["fingerprint"]

    @property
    def num_layers(self) -> int:
        return self.meta["model"]["num_layers"]

    @property
    def _where(self) -> str:
        return str(self.path) if self.path is not None else "(not saved)"

    def check_model(self, source) -> None:
        """ProfileError unless this profile was calibrated on `source` (a ModelSource)."""
        if source.fingerprint != self.fingerprint:
            model = self.meta["model"]
            raise ProfileError(
                f"profile {self._where} was calibrated on model {model['spec']} (fingerprint "
                f"{self.fingerprint[:16]}), not {source.spec} (fingerprint "
                f"{source.fingerprint[:16]}): recalibrate with kvcalib calibrate {source.spec} "
                "-o DIR"
            )

    # -- what kvcalib.core.plan asks for -------------------------------------------------------

    def range(
        self, tensor: str, layer: int, *, position: str = "post_rope", outliers: float = 0.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(lo, hi), each float32 [Hkv, D], over non-sink tokens, with the fraction `outliers`
        left out (half at each end); "value" ignores `position`."""
        q = self._get(f"{self._kind(tensor, position)}.nonsink.quantiles")[self._layer(layer)]
        found = select_range(q, outliers)
        if found is None:
            raise ProfileError(
                f"profile {self._where}: no {tensor} range with outliers = {outliers}; the "
                f"calibrated fractions are {', '.join(map(str, OUTLIER_FRACTIONS))}"
            )
        return found

    def codebook(self, variant: str, layer: int, bits: int) -> torch.Tensor:
        """Sorted levels float32 [2**bits] in the normalized domain `variant` (as named by
        kvcalib.core.plan.codebook_variant)."""
        name = f"codebook.{variant}.{bits}"
        if name not in self.tensors:
            books = [
                n.removeprefix("codebook.").rsplit(".", 1)
                for n in self.tensors
                if n.startswith("codebook.")
            ]
            have = sorted({v for v, _ in books})
            bits_have = sorted({int(b) for _, b in books})
            if not have:
                what = "no codebooks (calibrated without the codebooks phase)"
            else:
                what = f"codebooks at {bits_have} bits for {', '.join(have)}"
            raise ProfileError(
                f"profile {self._where} has no {bits}-bit codebook for {variant!r}; it has "
                f"{what}: use a uniform codebook or one of these"
            )
        return self.tensors[name][self._layer(layer)].clone()

    def vector_codebook(self, variant: str, layer: int, bits: int) -> torch.Tensor:
        """Entries float32 [Hc, 2**bits, w] of a "vq" codebook `variant` (as named by
        kvcalib.core.plan.codebook_variant)."""
        name = f"vqbook.{variant}.{bits}"
        if name not in self.tensors:
            have = sorted(n[len("vqbook.") :] for n in self.tensors if n.startswith("vqbook."))
            raise ProfileError(
                f"profile {self._where} has no {bits}-bit vector codebook for {variant!r}; it "
                f"has {', '.join(have) or 'none (calibrated before vector codebooks)'}: "
                "calibrate again, or use one of these"
            )
        return self.tensors[name][self._layer(layer)].clone()

    def outlier_channels(
        self, tensor: str, layer: int, count: int, *, position: str = "post_rope"
    ) -> torch.Tensor:
        """int64 [Hkv, count], sorted: per KV head the `count` channels of largest RMS over
        every calibration token (sqrt(mean² + std²)); "value" ignores `position`."""
        kind = self._kind(tensor, position)
        i = self._layer(layer)
        mean, std = self._get(f"{kind}.all.mean")[i], self._get(f"{kind}.all.std")[i]
        if not 0 < count <= mean.shape[-1]:
            raise ProfileError(f"{count} outlier channels of {mean.shape[-1]}: use 1 to that")
        rms = (mean.double() ** 2 + std.double() ** 2).sqrt()
        return rms.topk(count, dim=-1).indices.sort(-1).values

    def smoothing(self, layer: int, alpha: float, *, position: str) -> torch.Tensor:
        """SmoothAttention-style key scales float32 [Hkv, D]: s_j = absmax_j ** alpha over
        non-sink keys at `position`, the max of each RoPE pair (j, j + D/2) on both members,
        normalized to geometric mean 1 per head."""
        absmax = self._get(f"{self._kind('key', position)}.nonsink.absmax")[self._layer(layer)]
        a = absmax.double().clamp_min(1e-6)
        half = a.shape[-1] // 2
        s = torch.maximum(a[:, :half], a[:, half:]).pow(alpha)
        s = (s / s.log().mean(-1, keepdim=True).exp()).float()
        return torch.cat((s, s), -1)

    def sink_predictor(self):
        """The calibrated kvcalib_runtime.cache.scheme.SinkPredictor."""

        p = self.meta.get("sink_predictor")
        if p is None:
            ratio = self.meta.get("massive", {}).get("ratio")
            raise ProfileError(
                f"profile {self._where} has no sink predictor: no residual dimension reached "
                f"{ratio}x its layer's median on the sink tokens; use a recipe without "
                "sinks.predicted"
            )
        return SinkPredictor(
            int(p["layer"]), tuple(int(d) for d in p["dims"]), float(p["threshold"])
        )

    def has_sensitivity(self, loss: str = "text") -> bool:
        """Whether the profile holds per-layer sensitivities of `loss` (SENSITIVITY_LOSSES)."""
        return f"{_SENSITIVITY[loss]}.key" in self.tensors

    def sensitivity(self, tensor: str, layer: int, bits: int, loss: str = "text") -> float:
        """KL divergence of the final logits with only this tensor of this layer quantized
        (estimated from the loss gradients, or measured; json "probe.method"): per token of the
        calibration text (`loss` "text"), or per answer token of the retrieval prompts
        ("answer")."""
        if tensor not in ("key", "value"):
            raise ProfileError(f"sensitivity of {tensor!r}: use 'key' or 'value'")
        name = f"{_SENSITIVITY[loss]}.{tensor}"
        if name not in self.tensors:
            what = "sensitivity phase" if loss == "text" else "answer-loss sensitivity"
            raise ProfileError(
                f"profile {self._where} has no {what}: recalibrate with kvcalib calibrate "
                "(all phases, --sensitivity fisher) to allocate bits per layer"
            )
        widths = self.meta["probe"]["bits"]
        if bits not in widths:
            raise ProfileError(
                f"profile {self._where}: no sensitivity at {bits} bits; calibrated: {widths}"
            )
        return float(self.tensors[name][self._layer(layer), widths.index(bits)])

    # -- helpers -------------------------------------------------------------------------------

    def _get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ProfileError(f"profile {self._where}: no tensor {name}; recalibrate it")
        return self.tensors[name]

    def _layer(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise ProfileError(
                f"profile {self._where}: layer {layer} out of range; the model has "
                f"{self.num_layers} layers"
            )
        return layer

    def _kind(self, tensor: str, position: str) -> str:
        if tensor == "value":
            return "value"
        if tensor != "key":
            raise ProfileError(f"tensor {tensor!r}: use 'key' or 'value'")
        if position not in KEY_POSITIONS:
            raise ProfileError(f"key position {position!r}: use one of {', '.join(KEY_POSITIONS)}")
        return f"key_{position}"
