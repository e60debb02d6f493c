"""profile.json: what a calibration found, how it ran and on what (kvcalib.core.profile lists
the fields), assembled from named parts."""

import dataclasses
import platform

import torch
import transformers

from kvcalib import __version__
from kvcalib.calibration import codebooks, sensitivity, vectorbooks
from kvcalib.calibration.massive import Massive
from kvcalib.calibration.observe import POSITION_BITS
from kvcalib.calibration.sinks import later_sinks, local_span
from kvcalib.calibration.stats import outlier_list
from kvcalib.core.profile import FORMAT_VERSION, OUTLIER_FRACTIONS, QUANTILE_LEVELS
from kvcalib_runtime.model.geometry import Geometry


@dataclasses.dataclass(frozen=True)
class Run:
    """How a calibration ran: what profile.json records beside its findings.

    data: the description of the text (kvcalib.core.data.describe); phases: those computed;
    settings: run.Settings."""

    device: str
    dtype: str
    sequential: bool
    data: dict | str
    seed: int
    phases: tuple[str, ...]
    settings: object


@dataclasses.dataclass
class Findings:
    """The profile tensors (kvcalib.core.profile names them), the massive activations and the
    sink predictor (JSON-ready, or None) of a calibration."""

    tensors: dict[str, torch.Tensor]
    massive: Massive
    predictor: dict | None
    answer: dict | None = None  # the retrieval prompts of the answer-loss sensitivity


def profile_meta(lm, tokenizer, source, found: Findings, run: Run) -> dict:
    """profile.json without its timings (added when the profile is written)."""
    cfg = lm.config
    ids = found.tensors["windows.input_ids"]
    n, t = ids.shape
    settings = run.settings
    return {
        "format_version": FORMAT_VERSION,
        "model": _model(cfg, source),
        "data": run.data,
        "num_samples": n,
        "seq_len": t,
        "seed": run.seed,
        "device": run.device,
        "dtype": run.dtype,
        "sequential": run.sequential,
        "phases": list(run.phases),
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
        "tokens": {"all": n * t, "nonsink": int((found.tensors["sinks.flags"] == 0).sum())},
        "probe": _probe(run, n, t, found.answer),
        "codebooks": _codebooks(lm, run, n),
        "layers": _layers(cfg, found, tokenizer, settings.outlier_ratio),
        "sinks": _sinks(found.tensors, tokenizer, settings),
        "massive": {
            "ratio": settings.massive_ratio,
            "first_layer": next((i for i, d in enumerate(found.massive.dims) if d), None),
        },
        "sink_predictor": found.predictor,
    }


def _model(cfg, source) -> dict:
    return {
        "spec": source.spec,
        "path": str(source.path),
        "fingerprint": source.fingerprint,
        "model_type": cfg.model_type,
        "num_layers": cfg.num_hidden_layers,
        "num_heads": cfg.num_attention_heads,
        "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": Geometry.from_config(cfg).head_dim,
        "hidden_size": cfg.hidden_size,
    }


def _probe(run: Run, n: int, t: int, answer: dict | None) -> dict | None:
    """The sensitivity measurement (kept under its historical name "probe"), or None; `answer`
    describes the retrieval prompts of the answer-loss sensitivity."""
    if "sensitivity" not in run.phases:
        return None
    s = run.settings
    if s.sensitivity == "fisher":
        described = sensitivity.describe("fisher", min(s.sensitivity_windows, n), t)
    else:
        windows, tokens = min(s.sensitivity_windows, n), min(s.sensitivity_tokens, t)
        described = sensitivity.describe("probe", windows, tokens)
    return {**described, "answer": answer}


def _codebooks(lm, run: Run, n: int) -> dict | None:
    if "codebooks" not in run.phases:
        return None
    return {
        "variants": list(codebooks.variants(lm, answer=run.settings.answer_codebooks)),
        "bits": list(codebooks.BITS),
        "windows": min(run.settings.codebook_windows, n),
        "bins": run.settings.histogram_bins,
        "vectors": {
            v: list(bits) for v, bits in vectorbooks.wanted(run.settings.vector_ablation).items()
        },
    }


def _decoder(tokenizer):
    def decode(token) -> str:
        return tokenizer.decode([int(token)])

    return decode


def _layers(cfg, found: Findings, tokenizer, ratio: float) -> list[dict]:
    """Per layer: token-0 attention and sink fraction, outlier channels, massive dims and the
    tokens carrying them."""
    tensors, massive = found.tensors, found.massive
    ids, decode = tensors["windows.input_ids"], _decoder(tokenizer)
    layers = []
    for i in range(cfg.num_hidden_layers):
        median = float(massive.median[i])
        layers.append(
            {
                "index": i,
                "token0_attention": [round(float(x), 4) for x in tensors["attention.token0"][i]],
                "token0_sink": round(float(tensors["sinks.token0"][i]), 4),
                "key_outlier_channels_pre_rope": outlier_list(
                    tensors["key_pre_rope.range_ratio"][i], ratio
                ),
                "key_outlier_channels_post_rope": outlier_list(
                    tensors["key_post_rope.range_ratio"][i], ratio
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
    return layers


def _sinks(tensors: dict, tokenizer, settings) -> dict:
    ids = tensors["windows.input_ids"]
    sinks = later_sinks(tensors, ids, _decoder(tokenizer))
    sinks["token0_layers"] = int((tensors["sinks.token0"] >= 0.5).sum())
    sinks["definition"] = (
        f"head-mean weight from queries >= {local_span(ids.shape[1])} tokens later exceeds "
        f"max({settings.sink_weight}, {settings.sink_ratio} x uniform) in >= "
        f"{settings.sink_layers} layers"
    )
    return sinks
