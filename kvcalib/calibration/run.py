"""`calibrate`: find where low-bit KV error will come from, on the user's model and text.

    profile = kvcalib.calibrate(None, "profile/")            # smollm2-135m, built-in text

The model runs one decoder layer at a time through a LayerSource (kvcalib.calibration.layerwise): in
memory window by window, or, when it does not fit (or with `sequential=True`), with each layer read
from the shards once per pass and every window run through it — the same code either way, so the
same profile bit for bit. Passes, each with its own progress bar and time:

  stats      one observed forward per window (observe.py): channel statistics, attention sinks,
             massive activations and the sink predictor, per-position key error
  gradients  one backward per gradient window (gradients.py), layer by layer: the Fisher
             sensitivity of every layer at every probed width (sensitivity.py) and the
             Fisher-weighted codebooks (codebooks.py; of vectors, vectorbooks.py) from the
             same gradients
  retrieval  with the sensitivity: retrieval prompts built from the calibration text
             (retrieval.py) and the loss of their answers, measured with each layer's keys or
             values quantized in turn (answerprobe.py: a forward and the answer's rows once per
             probe) or estimated from its gradients (Settings(answer_sensitivity="fisher"): a
             forward and a backward): the answer-loss sensitivity ("sensitivity.answer.*"),
             which kvcalib-2 allocates by together with the text's; the backward also runs
             for codebooks weighted "fisher+answer" (scalar ones ending ":answer",
             codebooks.py; vector ones, vectorbooks.py), whose k-means follows it
  probe      with Settings(sensitivity="probe") only: the KL of the logits with one layer's keys
             or values quantized, measured directly (sensitivity.py)

The profile (kvcalib.core.profile) and its report are written atomically to `output_dir`.
"""

import dataclasses
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from kvcalib.calibration import answerprobe, gradients, retrieval, sensitivity, vectorbooks
from kvcalib.calibration.codebooks import Codebooks, variants
from kvcalib.calibration.layerwise import (
    ActivationStore,
    InMemory,
    LayerSource,
    LayerwiseModel,
    fits_in_memory,
)
from kvcalib.calibration.meta import Findings, Run, profile_meta
from kvcalib.calibration.observe import stats_pass
from kvcalib.calibration.progress import Progress
from kvcalib.calibration.report import write_report
from kvcalib.calibration.stats import range_ratio
from kvcalib.core import options, preflight
from kvcalib.core.data import calibration_tokens, calibration_windows, describe
from kvcalib.core.models import load_model
from kvcalib.core.profile import Profile, select_range
from kvcalib.errors import DataError, OutputError
from kvcalib.io.atomic import check_output, staging

PHASES = ("stats", "sensitivity", "codebooks")
TEXT_SENSITIVITY = ("sensitivity.key", "sensitivity.value")
SEQ_LEN = 512  # tokens per calibration window unless told (the default calibration's)


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
    sensitivity          "fisher" (from the gradient pass, nearly free) or "probe" (the KL
                         measured with each layer quantized: 2 x layers x widths branches)
    sensitivity_windows  windows of the sensitivity: whole windows with a backward (fisher), or
                         the first `sensitivity_tokens` tokens of them, batched (probe)
    codebook_windows     windows with a backward for the codebooks' Fisher weights (the gradient
                         pass runs max(sensitivity_windows, codebook_windows) with fisher)
    histogram_bins       bins of the normalized domain [0, 1] for the codebook k-means
    retrieval_prompts    retrieval prompts for the answer-loss sensitivity (0: none), each
                         `retrieval_tokens` long (at most the model's context); 8, not 16
                         since 2026-12-06: half the probe's cost, and on Qwen2.5-0.5B's 4K
                         suite kvcalib-2 from 8 answered within the interval of 16's (issue 56)
    answer_sensitivity   how it is measured: "probe" (the answer's NLL with each layer's keys
                         or values quantized in turn, answerprobe.py) or "fisher" (the Fisher
                         estimate from the answer loss's gradients, sensitivity.py)
    answer_probe         what the probe measures (answerprobe.MODES): "screen" every tensor at
                         2 bits and the third with the largest loss there at 3 too, the
                         allocation's cut; "cut" every tensor at 2 and 3 bits; both extrapolate
                         the rest by the text's Fisher sensitivity (which must be in by then,
                         else every width is measured); "all" measures all four widths
    vector_ablation      also fit the vector codebooks of kvcalib-1.5's one-factor neighbours
                         (benchmarks/kvcalib-1.5-ablation/), not only the presets' own
    answer_codebooks     also fit each preset's scalar codebook weighted by the retrieval
                         prompts' answer loss beside the text's (variants ending ":answer")
    """

    outlier_ratio: float = 4.0
    sink_weight: float = 0.05
    sink_ratio: float = 10.0
    sink_layers: int = 2
    massive_ratio: float = 100.0
    sensitivity: str = "fisher"
    sensitivity_windows: int = 4
    sensitivity_tokens: int = 256
    codebook_windows: int = 2
    histogram_bins: int = 1024
    retrieval_prompts: int = 8
    retrieval_tokens: int = 1024
    answer_sensitivity: str = "probe"
    answer_probe: str = "screen"
    vector_ablation: bool = False
    answer_codebooks: bool = False

    def __post_init__(self):
        for name in ("outlier_ratio", "sink_ratio", "massive_ratio"):
            if getattr(self, name) <= 1:
                raise ValueError(f"{name} = {getattr(self, name)}: a ratio must be > 1")
        if not 0 < self.sink_weight < 1:
            raise ValueError(f"sink_weight = {self.sink_weight}: an attention weight in (0, 1)")
        for name in ("sink_layers", "sensitivity_windows", "codebook_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)} must be >= 1")
        if self.sensitivity not in sensitivity.METHODS:
            raise ValueError(
                f"sensitivity = {self.sensitivity!r}: use one of {', '.join(sensitivity.METHODS)}"
            )
        if self.answer_sensitivity not in sensitivity.METHODS:
            raise ValueError(
                f"answer_sensitivity = {self.answer_sensitivity!r}: use one of "
                f"{', '.join(sensitivity.METHODS)}"
            )
        if self.answer_probe not in answerprobe.MODES:
            raise ValueError(
                f"answer_probe = {self.answer_probe!r}: use one of {', '.join(answerprobe.MODES)}"
            )
        if self.sensitivity_tokens < 2 or self.histogram_bins < 16:
            raise ValueError("sensitivity_tokens must be >= 2 and histogram_bins >= 16")
        for name in ("vector_ablation", "answer_codebooks"):
            if getattr(self, name) and not self.retrieval_prompts:
                raise ValueError(
                    f"{name} fits answer-weighted codebooks: use retrieval_prompts >= 1"
                )
        if self.retrieval_prompts < 0 or self.retrieval_tokens < 2 * retrieval.MIN_HAYSTACK:
            raise ValueError(
                f"retrieval_prompts = {self.retrieval_prompts}, retrieval_tokens = "
                f"{self.retrieval_tokens}: use >= 0 prompts of >= {2 * retrieval.MIN_HAYSTACK}"
            )


def calibrate(
    model,
    output_dir,
    *,
    data=None,
    num_samples: int = 16,
    seq_len: int = SEQ_LEN,
    seed: int = 0,
    device: str = "cpu",
    dtype: str | torch.dtype = "float32",
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
    dtype:       "float32", "float16", "bfloat16" or the torch dtype
    sequential:  True: layer by layer from the shards, one decoder layer in memory at a time;
                 False: the whole model in memory; None: layer by layer when the weights do not
                 fit in the memory free on `device` (kvcalib.calibration.layerwise.fits_in_memory)
    offload_dir: keep the activations between layers in files under this folder instead of
                 in memory (implies sequential)
    """

    clock = time.perf_counter()
    source = preflight.calibration(  # every input and option, before minutes of work, not after
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
    dtype = options.dtype("--dtype", dtype)
    if offload_dir is not None:
        if sequential is False:
            raise OutputError(
                f"--offload-dir {offload_dir}: activations are offloaded between layers, so "
                "only a sequential calibration offloads; drop --in-memory or --offload-dir"
            )
        sequential = True
    if sequential is None:
        sequential = not fits_in_memory(source.path, dtype, device, quiet=not progress)
    if sequential:
        net = LayerwiseModel(
            source, device=device, dtype=dtype, trust_remote_code=trust_remote_code
        )
        tokenizer = AutoTokenizer.from_pretrained(source.path, trust_remote_code=trust_remote_code)
    else:
        net, tokenizer = load_model(
            model, device=device, dtype=dtype, trust_remote_code=trust_remote_code
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
    seq_len: int = SEQ_LEN,
    seed: int = 0,
    phases=PHASES,
    force: bool = False,
    settings: Settings = Settings(),
    progress: bool = True,
    timings: dict | None = None,
    offload_dir=None,
) -> Profile:
    """`calibrate` on an already loaded transformers model (eval mode), or on a
    kvcalib.calibration.layerwise.LayerSource (LayerwiseModel: from shards), and its tokenizer;
    `source` is its kvcalib.core.models.ModelSource (for the fingerprint)."""

    lm = model if isinstance(model, LayerSource) else InMemory(model)
    phases = _check(lm, tuple(phases), num_samples, seq_len, offload_dir)
    out = Path(output_dir)
    check_output(out, force, [], kind="profile")
    ids = calibration_windows(
        tokenizer,
        data,
        num_samples=num_samples,
        seq_len=seq_len,
        seed=seed,
        vocab=lm.config.vocab_size,
    ).to(lm.device)
    clock = Progress(progress, timings)
    keep = gradient_windows(settings, phases, num_samples)
    with ActivationStore(offload_dir) as store:
        found = statistics(lm, ids, settings, store, clock, keep)
        books = codebook_consumers(lm, found, settings, phases)
        if keep:
            fisher(lm, ids[:keep], found, settings, phases, store, clock, books)
        answer = "sensitivity" in phases
        if answer or any(b.answers_wanted() for b in books):
            text = calibration_tokens(tokenizer, data, vocab=lm.config.vocab_size)
            layer_work, head_work = lm.work()
            forward = ids.numel() * (lm.config.num_hidden_layers * layer_work + head_work)
            retrieval_pass(
                lm,
                tokenizer,
                text,
                found,
                settings,
                seed,
                store,
                clock,
                answer=answer,
                books=books,
                forward=forward,
            )
        for consumer in books:  # the k-means, once the text's and the prompts' weights are in
            vectors = isinstance(consumer, vectorbooks.VectorBooks)
            with clock.timed("vector codebooks" if vectors else "results"):
                found.tensors.update(consumer.result())
        if "sensitivity" in phases and settings.sensitivity == "probe":
            probe(lm, ids, found, settings, store, clock)
    run = Run(
        device=str(lm.device),
        dtype=options.DTYPE_NAMES[lm.dtype],
        sequential=isinstance(lm, LayerwiseModel),
        data=describe(data, "calibration"),
        seed=seed,
        phases=phases,
        settings=settings,
    )
    profile = Profile(profile_meta(lm, tokenizer, source, found, run), found.tensors)
    return write(profile, out, force, clock)


def _check(lm: LayerSource, phases: tuple, num_samples: int, seq_len: int, offload_dir) -> tuple:
    """The phases, once the request is known to be possible."""
    if set(phases) - set(PHASES) or "stats" not in phases:
        raise ValueError(f"phases = {phases}: a subset of {PHASES} that includes 'stats'")
    if num_samples < 1 or seq_len < 16:
        raise ValueError(f"num_samples = {num_samples}, seq_len = {seq_len}: use >= 1 and >= 16")
    max_len = getattr(lm.config, "max_position_embeddings", None)
    if max_len and seq_len > max_len:
        raise DataError(
            f"--seq-len {seq_len} exceeds the model's context ({max_len} tokens): use at most that"
        )
    if offload_dir is not None and not isinstance(lm, LayerwiseModel):
        raise ValueError("offload_dir: only a LayerwiseModel (layer by layer) offloads")
    return tuple(p for p in PHASES if p in phases)


def gradient_windows(settings: Settings, phases: tuple, num_samples: int) -> int:
    """How many windows (the first ones) the gradient pass runs: 0 when nothing needs it."""
    n = settings.codebook_windows if "codebooks" in phases else 0
    if "sensitivity" in phases and settings.sensitivity == "fisher":
        n = max(n, settings.sensitivity_windows)
    return min(n, num_samples)


def statistics(lm, ids, settings: Settings, store, clock: Progress, keep: int) -> Findings:
    """The stats pass over windows ids [N, T] and what follows from it: range ratios, the sink
    predictor. Keeps the first `keep` windows' layer inputs in `store` (gradient pass)."""
    layer_work, _ = lm.work()
    with clock.phase("stats", len(ids) * lm.config.num_hidden_layers * layer_work) as advance:
        tensors, massive = stats_pass(lm, ids, settings, store, advance, keep)
    tensors["windows.input_ids"] = ids.cpu()
    for kind in ("key_pre_rope", "key_post_rope"):
        lo, hi = tensors[f"{kind}.nonsink.min"], tensors[f"{kind}.nonsink.max"]
        tensors[f"{kind}.range_ratio"] = range_ratio(lo, hi)
    flags, judged = tensors["sinks.flags"].bool(), tensors["sinks.judged"].bool()
    return Findings(tensors, massive, massive.fit(flags, judged))


def codebook_consumers(lm, found: Findings, settings: Settings, phases) -> list:
    """The scalar and vector codebooks' consumers of the gradient passes ([] without
    "codebooks"): the text windows' samples go in first, the retrieval prompts' after."""
    if "codebooks" not in phases:
        return []
    t = found.tensors
    flags = t["sinks.flags"].bool()
    quantiles = {p: t[f"key_{p}.nonsink.quantiles"] for p in ("pre_rope", "post_rope")}
    layers, windows = lm.config.num_hidden_layers, settings.codebook_windows
    return [
        Codebooks(
            variants(lm, answer=settings.answer_codebooks),
            layers,
            settings.histogram_bins,
            flags,
            quantiles,
            windows,
        ),
        vectorbooks.VectorBooks(
            vectorbooks.wanted(settings.vector_ablation),
            layers,
            flags,
            vectorbooks.ranges(t),
            windows,
        ),
    ]


def fisher(lm, ids, found: Findings, settings: Settings, phases, store, clock, books=()) -> None:
    """The gradient pass over windows ids [K, T]: the Fisher sensitivity (with phases'
    "sensitivity") into found.tensors, and the text's samples into the codebooks' consumers
    `books` (codebook_consumers)."""
    consumers = []
    if "sensitivity" in phases and settings.sensitivity == "fisher":
        quantiles = found.tensors["key_pre_rope.nonsink.quantiles"]
        key_range = select_range(quantiles, sensitivity.KEY_RANGE_OUTLIERS)
        counted = ~found.tensors["sinks.flags"].bool()[: settings.sensitivity_windows]
        predicted = len(counted) * (ids.shape[1] - 1)
        consumers.append(sensitivity.FisherSensitivity(key_range, counted, predicted))
    with clock.phase("gradients", gradients.work(lm, len(ids))) as advance:
        gradients.gradient_pass(lm, ids, store, [*consumers, *books], advance)
    for consumer in consumers:
        with clock.timed("results"):
            found.tensors.update(consumer.result())


def retrieval_pass(
    lm, tokenizer, text, found, settings, seed, store, clock, *, answer, books, forward=1.0
):
    """The retrieval prompts built from the calibration text's token ids [n] (retrieval.py) and
    what they serve: with `answer`, the answer-loss sensitivity into found.tensors and what it
    ran on into found.answer (or why it did not run: {"skipped": reason}); the prompts' answer
    gradients into the codebooks' consumers `books` that ask for them (weight "fisher+answer":
    the gradient pass then runs whatever the sensitivity's method, and no prompt is an error)."""
    draws = [b for b in books if b.answers_wanted()]
    context = getattr(lm.config, "max_position_embeddings", None) or settings.retrieval_tokens
    length = min(settings.retrieval_tokens, context)
    prompts, skipped = None, "retrieval_prompts = 0"
    if settings.retrieval_prompts:
        prompts = retrieval.build(tokenizer, text, settings.retrieval_prompts, length, seed)
        skipped = f"no retrieval prompt fits {length} tokens of this text"
    if prompts is None:
        if draws:
            raise DataError(f"answer-weighted codebooks need retrieval prompts: {skipped}")
        found.answer = {"skipped": skipped}
        return
    quantiles = found.tensors["key_pre_rope.nonsink.quantiles"]
    key_range = select_range(quantiles, sensitivity.KEY_RANGE_OUTLIERS)
    ids = prompts.ids.to(lm.device)
    layer_work, _ = lm.work()
    answers = int(prompts.answer.sum())
    measured = answer and settings.answer_sensitivity == "probe"
    estimated = answer and not measured
    predictor = found.predictor
    # the probe needs only the sinks; the gradient pass also the inputs of every layer
    depth = lm.config.num_hidden_layers
    if not (estimated or draws):
        depth = predictor["layer"] + 1 if predictor is not None else 0
    kept = store if estimated or draws else None
    with clock.phase("retrieval", len(ids) * depth * layer_work) as advance:
        sinks = gradients.keep_inputs(lm, ids, kept, advance, predictor)
    counted = prompts.context & ~sinks
    mode = "all"
    if measured:
        text = {k: v for k, v in found.tensors.items() if k in TEXT_SENSITIVITY}
        if len(text) == len(TEXT_SENSITIVITY):  # else the text's comes later: measure all
            mode = settings.answer_probe
        work = answerprobe.work(lm, len(ids), length, answers, mode)
        clock.note(
            f"answer probe: {len(ids)} prompts x {length} tokens, {_measures(mode, lm)}, "
            f"predicted {work / forward:.1f}x the arithmetic of a forward over the calibration "
            f"tokens ({answerprobe.work(lm, len(ids), length, answers) / forward:.1f}x with "
            "--answer-probe all)"
        )
        with clock.phase("answer probe", work) as advance:
            measures, which = answerprobe.answer_pass(
                lm, prompts, counted, key_range, advance, mode
            )
        if mode != "all":
            measures = answerprobe.extrapolate(measures, text, which)
        found.tensors.update(measures)
    consumers = [b.answer_consumer(counted) for b in draws]
    if estimated:
        fisher_sum = sensitivity.FisherSensitivity(
            key_range, counted, answers, name="sensitivity.answer"
        )
        consumers.append(fisher_sum)
    if consumers:
        with clock.phase("answer gradients", gradients.work(lm, len(ids))) as advance:
            gradients.gradient_pass(lm, ids, store, consumers, advance, targets=prompts.answer)
    if estimated:
        found.tensors.update(fisher_sum.result())
    if answer:
        found.answer = {
            "method": settings.answer_sensitivity,
            "prompts": len(prompts),
            "tokens": length,
            "kinds": list(retrieval.KINDS),
            "answer_tokens": answers,
            "context_tokens": int(counted.sum()),
        }
        if measured:
            widths, screen = answerprobe.MODES[mode]
            found.answer["probe"] = mode
            found.answer["widths"] = list(widths)
            if screen:
                bits = sensitivity.BITS[sensitivity.BITS.index(max(widths)) + 1]
                column = sensitivity.BITS.index(bits)
                found.answer["screened"] = {"bits": bits} | {
                    t: which[t][:, column].nonzero()[:, 0].tolist() for t in sensitivity.TENSORS
                }
            if mode != "all":
                found.answer["extrapolated"] = "from the widest measured width by the text's loss"


def _measures(mode: str, lm) -> str:
    """What the probe measures in `mode`, for the note before it runs."""
    widths, screen = answerprobe.MODES[mode]
    out = f"every tensor at {', '.join(str(b) for b in widths)} bits"
    if screen:
        bits = sensitivity.BITS[sensitivity.BITS.index(max(widths)) + 1]
        n = answerprobe.screened(lm.config.num_hidden_layers)
        out += f", the {n} with the largest loss at {bits} too"
    return out


def probe(lm, ids, found: Findings, settings: Settings, store, clock: Progress) -> None:
    """The probe's sensitivity on the first windows and tokens of ids [N, T]."""
    quantiles = found.tensors["key_pre_rope.nonsink.quantiles"]
    key_range = select_range(quantiles, sensitivity.KEY_RANGE_OUTLIERS)
    sens_ids = ids[: settings.sensitivity_windows, : settings.sensitivity_tokens]
    with clock.phase("probe", sensitivity.probe_work(lm)) as advance:
        found.tensors.update(sensitivity.probe_pass(lm, sens_ids, key_range, store, advance))


def write(profile: Profile, out: Path, force: bool, clock: Progress) -> Profile:
    """The profile files and the report into `out`, atomically; the report's time is in the
    profile's timings, not in the report's."""

    def record(timings: dict) -> None:
        profile.meta["timings"] = {k: round(v, 2) for k, v in timings.items()}

    record(clock.timings)
    with staging(out, force) as tmp:
        with clock.timed("report"):
            write_report(profile, tmp)
        record({**clock.timings, "total": sum(clock.timings.values())})
        profile.write(tmp)
    profile.path = out
    return profile
