"""`calibrate`: find where low-bit KV error will come from, on the user's model and text.

    profile = kvcalib.calibrate(None, "profile/")            # smollm2-135m, built-in text

Phases (timed, one progress bar over all of them):
  stats        one observed forward per window (observe.py): channel statistics, attention
               sinks, massive activations and the sink predictor, per-position key error
  sensitivity  KL of the logits with one layer's keys or values quantized (sensitivity.py)
  codebooks    Fisher-weighted k-means levels per layer and normalized domain (codebooks.py)
The profile (kvcalib.profile) and its report are written atomically to `output_dir`.

When the model does not fit in memory (or with `sequential=True`), the same phases run layer by
layer on weights read from the shards (sequential.py), with the same result.
"""

import contextlib
import dataclasses
import platform
import sys
import time
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from kvcalib import __version__
from kvcalib.calibration import codebooks, sensitivity
from kvcalib.calibration import sequential as layer_by_layer
from kvcalib.calibration.observe import POSITION_BITS, stats_pass
from kvcalib.calibration.report import write_report
from kvcalib.calibration.sinks import later_sinks, local_span
from kvcalib.calibration.stats import outlier_list, range_ratio
from kvcalib.core import options, preflight
from kvcalib.core.data import calibration_windows, describe
from kvcalib.core.models import load_model
from kvcalib.core.profile import (
    FORMAT_VERSION,
    OUTLIER_FRACTIONS,
    QUANTILE_LEVELS,
    Profile,
    select_range,
)
from kvcalib.errors import DataError, OutputError
from kvcalib.io.atomic import check_output, staging
from kvcalib.sim.layerwise import ActivationStore, LayerwiseModel, fits_in_memory
from kvcalib_runtime.geometry import Geometry

PHASES = ("stats", "sensitivity", "codebooks")
DTYPES, DTYPE_NAMES = options.DTYPES, options.DTYPE_NAMES


@dataclasses.dataclass(frozen=True)
class Settings:
    """Thresholds and budgets of a calibration (closed: an unknown field is a TypeError).

    outlier_ratio        a key channel is an outlier when its non-sink range exceeds this times
                         its head's median channel range
    sink_weight, sink_ratio, sink_layers
                         a position is a sink of a layer when its head-mean weight from distant
                         queries exceeds max(sink_weight, sink_ratio x uniform), and a sink when
                         that holds in >= sink_layers layers (sinks.py)
    massive_ratio        a residual dim is massive when max |h| >= this times the median |h|
    sensitivity_windows, sensitivity_tokens
                         the sensitivity phase runs on the first `tokens` tokens of the first
                         `windows` windows, batched: 2 x layers x 3 forwards, the dominant cost
                         (30 layers: 180 forwards of 2 x 256 tokens, ~1 min on 2 idle cores)
    codebook_windows     windows with a backward pass for the Fisher weights
    histogram_bins       bins of the normalized domain [0, 1] for the codebook k-means
    """

    outlier_ratio: float = 4.0
    sink_weight: float = 0.05
    sink_ratio: float = 10.0
    sink_layers: int = 2
    massive_ratio: float = 100.0
    sensitivity_windows: int = 2
    sensitivity_tokens: int = 256
    codebook_windows: int = 2
    histogram_bins: int = 1024

    def __post_init__(self):
        for name in ("outlier_ratio", "sink_ratio", "massive_ratio"):
            if getattr(self, name) <= 1:
                raise ValueError(f"{name} = {getattr(self, name)}: a ratio must be > 1")
        if not 0 < self.sink_weight < 1:
            raise ValueError(f"sink_weight = {self.sink_weight}: an attention weight in (0, 1)")
        for name in ("sink_layers", "sensitivity_windows", "codebook_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)} must be >= 1")
        if self.sensitivity_tokens < 2 or self.histogram_bins < 16:
            raise ValueError("sensitivity_tokens must be >= 2 and histogram_bins >= 16")


def calibrate(
    model,
    output_dir,
    *,
    data=None,
    num_samples: int = 16,
    seq_len: int = 512,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "float32",
    phases=PHASES,
    force: bool = False,
    settings: Settings = Settings(),
    progress: bool = True,
    sequential: bool | None = None,
    offload_dir=None,
    trust_remote_code: bool = False,
) -> Profile:
    """Calibrate a model spec (None: smollm2-135m) on `data` (None: the built-in calibration
    text) and write the profile folder `output_dir`; returns the Profile.

    device:      "cpu", "cuda", "cuda:1", or "auto" (every visible GPU, else the CPU)
    sequential:  True: layer by layer, one decoder layer in memory at a time (sequential.py);
                 False: the whole model in memory; None: layer by layer when the weights do not
                 fit in the memory free on `device` (kvcalib.layerwise.fits_in_memory)
    offload_dir: keep the activations between layers in files under this folder instead of
                 in memory (implies sequential)
    """

    clock = time.perf_counter()
    source = preflight.calibrate(  # every input and option, before minutes of work, not after
        model,
        output_dir,
        data=data,
        num_samples=num_samples,
        seq_len=seq_len,
        seed=seed,
        device=device,
        dtype=dtype,
        force=force,
        offload_dir=offload_dir,
        trust_remote_code=trust_remote_code,
    )
    dtype = DTYPE_NAMES[options.dtype("--dtype", dtype)]
    if offload_dir is not None:
        if sequential is False:
            raise OutputError(
                f"--offload-dir {offload_dir}: activations are offloaded between layers, so "
                "only a sequential calibration offloads; drop --in-memory or --offload-dir"
            )
        sequential = True
    if sequential is None:
        sequential = not fits_in_memory(source.path, DTYPES[dtype], device, quiet=not progress)
    if sequential:
        net = LayerwiseModel(
            source, device=device, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code
        )
        tokenizer = AutoTokenizer.from_pretrained(source.path, trust_remote_code=trust_remote_code)
    else:
        net, tokenizer = load_model(
            model, device=device, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code
        )
    return calibrate_model(
        net,
        tokenizer,
        output_dir,
        source=net.kvcalib_source,
        data=data,
        num_samples=num_samples,
        seq_len=seq_len,
        seed=seed,
        phases=phases,
        force=force,
        settings=settings,
        progress=progress,
        timings={"load": time.perf_counter() - clock},
        offload_dir=offload_dir,
    )


def calibrate_model(
    model,
    tokenizer,
    output_dir,
    *,
    source,
    data=None,
    num_samples: int = 16,
    seq_len: int = 512,
    seed: int = 0,
    phases=PHASES,
    force: bool = False,
    settings: Settings = Settings(),
    progress: bool = True,
    timings: dict | None = None,
    offload_dir=None,
) -> Profile:
    """`calibrate` on an already loaded transformers model (eval mode), or on a
    kvcalib.layerwise.LayerwiseModel (layer by layer), and its tokenizer; `source` is its
    kvcalib.models.ModelSource (for the fingerprint)."""

    phases = tuple(phases)
    if set(phases) - set(PHASES) or "stats" not in phases:
        raise ValueError(f"phases = {phases}: a subset of {PHASES} that includes 'stats'")
    if num_samples < 1 or seq_len < 16:
        raise ValueError(f"num_samples = {num_samples}, seq_len = {seq_len}: use >= 1 and >= 16")
    max_len = getattr(model.config, "max_position_embeddings", None)
    if max_len and seq_len > max_len:
        raise DataError(
            f"--seq-len {seq_len} exceeds the model's context ({max_len} tokens): use at most that"
        )
    out = Path(output_dir)
    check_output(out, force, [], kind="profile")
    timings = dict(timings or {})
    layerwise = isinstance(model, LayerwiseModel)
    if offload_dir is not None and not layerwise:
        raise ValueError("offload_dir: only a LayerwiseModel (layer by layer) offloads")
    device = model.device if layerwise else next(model.parameters()).device
    dtype = model.dtype if layerwise else next(model.parameters()).dtype
    vocab = model.config.vocab_size
    ids = calibration_windows(
        tokenizer, data, num_samples=num_samples, seq_len=seq_len, seed=seed, vocab=vocab
    ).to(device)
    layers = model.config.num_hidden_layers
    sens_ids = ids[: settings.sensitivity_windows, : settings.sensitivity_tokens]
    code_ids = ids[: settings.codebook_windows]
    steps = {
        "stats": num_samples,
        "sensitivity": 2 * layers * len(sensitivity.BITS),
        "codebooks": len(code_ids),
    }
    if layerwise:
        steps = layer_by_layer.steps(num_samples, layers, len(code_ids))
        store = ActivationStore(offload_dir)
        keep = len(code_ids) if "codebooks" in phases else 0
        passes = {
            "stats": lambda *a: layer_by_layer.stats_pass(model, *a, store, keep),
            "sensitivity": lambda *a: layer_by_layer.sensitivity_pass(model, *a, store),
            "codebooks": lambda *a: layer_by_layer.codebook_pass(model, *a, store),
        }
    else:
        store = contextlib.nullcontext()
        passes = {
            "stats": lambda *a: stats_pass(model, *a),
            "sensitivity": lambda *a: sensitivity.sensitivity_pass(model, *a),
            "codebooks": lambda *a: codebooks.codebook_pass(model, *a),
        }
    bar = tqdm(
        total=sum(steps[p] for p in phases),
        file=sys.stderr,
        disable=not progress,
        unit="step",
        desc="stats",
    )
    with bar, store:
        with _timed(timings, "stats", bar):
            tensors, massive = passes["stats"](ids, settings, bar.update)
            tensors["windows.input_ids"] = ids.cpu()
            for kind in ("key_pre_rope", "key_post_rope"):
                lo, hi = tensors[f"{kind}.nonsink.min"], tensors[f"{kind}.nonsink.max"]
                tensors[f"{kind}.range_ratio"] = range_ratio(lo, hi)
            flags, judged = tensors["sinks.flags"].bool(), tensors["sinks.judged"].bool()
            predictor = massive.fit(flags, judged)
        quantiles = {p: tensors[f"key_{p}.nonsink.quantiles"] for p in ("pre_rope", "post_rope")}
        if "sensitivity" in phases:
            with _timed(timings, "sensitivity", bar):
                key_range = select_range(quantiles["pre_rope"], sensitivity.KEY_RANGE_OUTLIERS)
                tensors.update(passes["sensitivity"](sens_ids, key_range, bar.update))
        if "codebooks" in phases:
            with _timed(timings, "codebooks", bar):
                tensors.update(
                    passes["codebooks"](
                        code_ids, flags, quantiles, settings.histogram_bins, bar.update
                    )
                )
    run = {"device": str(device), "dtype": str(dtype)[6:], "sequential": layerwise}
    meta = _meta(
        model,
        run,
        tokenizer,
        source,
        tensors,
        massive,
        predictor,
        settings,
        describe(data, "calibration"),
        seed,
        phases,
        timings,
    )
    profile = Profile(meta, tensors)
    with staging(out, force) as tmp:
        clock = time.perf_counter()
        write_report(profile, tmp)
        timings["report"] = time.perf_counter() - clock
        timings["total"] = sum(timings.values())
        meta["timings"] = {k: round(v, 2) for k, v in timings.items()}
        profile.write(tmp)
    profile.path = out
    return profile


@contextlib.contextmanager
def _timed(timings: dict, phase: str, bar):
    """Name the phase on the progress bar and record its seconds in `timings`."""
    bar.set_description(phase)
    start = time.perf_counter()
    yield
    timings[phase] = time.perf_counter() - start


def _meta(
    model, run, tokenizer, source, tensors, massive, predictor, settings, data, seed, phases, times
) -> dict:
    """profile.json (see kvcalib.profile for its fields)."""

    cfg = model.config
    ids = tensors["windows.input_ids"]
    n, t = ids.shape

    def decode(token) -> str:
        return tokenizer.decode([int(token)])

    r = settings.outlier_ratio
    layers = []
    for i in range(cfg.num_hidden_layers):
        median = float(massive.median[i])
        layers.append(
            {
                "index": i,
                "token0_attention": [round(float(x), 4) for x in tensors["attention.token0"][i]],
                "token0_sink": round(float(tensors["sinks.token0"][i]), 4),
                "key_outlier_channels_pre_rope": outlier_list(
                    tensors["key_pre_rope.range_ratio"][i], r
                ),
                "key_outlier_channels_post_rope": outlier_list(
                    tensors["key_post_rope.range_ratio"][i], r
                ),
                "massive_dims": [
                    [
                        d,
                        round(float(massive.max_abs[i, d]), 2),
                        round(float(massive.max_abs[i, d]) / median, 1),
                    ]
                    for d in massive.dims[i]
                ],
                "massive_tokens": massive.carriers(i, ids, decode) if massive.dims[i] else [],
            }
        )
    sinks = later_sinks(tensors, ids, decode)
    sinks["token0_layers"] = int((tensors["sinks.token0"] >= 0.5).sum())
    sinks["definition"] = (
        f"head-mean weight from queries >= {local_span(t)} tokens later exceeds "
        f"max({settings.sink_weight}, {settings.sink_ratio} x uniform) in >= "
        f"{settings.sink_layers} layers"
    )
    first = next((i for i, d in enumerate(massive.dims) if d), None)
    return {
        "format_version": FORMAT_VERSION,
        "model": {
            "spec": source.spec,
            "path": str(source.path),
            "fingerprint": source.fingerprint,
            "model_type": cfg.model_type,
            "num_layers": cfg.num_hidden_layers,
            "num_heads": cfg.num_attention_heads,
            "num_kv_heads": cfg.num_key_value_heads,
            "head_dim": Geometry.from_config(cfg).head_dim,
            "hidden_size": cfg.hidden_size,
        },
        "data": data,
        "num_samples": n,
        "seq_len": t,
        "seed": seed,
        **run,  # device, dtype, sequential
        "phases": list(phases),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "kvcalib": __version__,
        },
        "settings": dataclasses.asdict(settings),
        "quantile_levels": list(QUANTILE_LEVELS),
        "outlier_fractions": list(OUTLIER_FRACTIONS),
        "position_error_bits": list(POSITION_BITS),
        "tokens": {"all": n * t, "nonsink": int((tensors["sinks.flags"] == 0).sum())},
        "probe": sensitivity.probe(
            min(settings.sensitivity_windows, n), min(settings.sensitivity_tokens, t)
        )
        if "sensitivity" in phases
        else None,
        "codebooks": {
            "variants": list(codebooks.variants(model)),
            "bits": list(codebooks.BITS),
            "windows": min(settings.codebook_windows, n),
            "bins": settings.histogram_bins,
        }
        if "codebooks" in phases
        else None,
        "timings": {k: round(v, 2) for k, v in times.items()},
        "layers": layers,
        "sinks": sinks,
        "massive": {"ratio": settings.massive_ratio, "first_layer": first},
        "sink_predictor": predictor,
    }
