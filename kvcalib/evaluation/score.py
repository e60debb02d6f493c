"""`kvcalib eval`: measure KV recipes against full precision on the same windows, in one run.

For every window the full-precision model runs once; every recipe then runs through the
Simulator (fake or decode mode) on the same tokens, and is scored against it:

    ppl       exp(mean next-token NLL) of the recipe; ppl_fp the same for full precision
    kld       mean per-token KL(p_fp || p_recipe) in nats
    top1      fraction of positions whose argmax agrees with full precision
    bits_per_element   what the runtime's cache allocates for the quantized body per element
              (codes, group metadata, outlier slots — used or not —, static ranges and
              codebooks), at the evaluated context, for an fp16 cache; measured by walking the
              buffers of a cache built on the meta device
    bits_at_context    everything that cache allocates per element (the residual window, sink
              slots and bookkeeping too), at the evaluated context, 4K and 32K tokens
    long_context       with `long_context` lengths: the long-context suite, task -> length ->
              cell: n, exact-match accuracy and its Wilson interval, answer NLL, and paired
              against fp16 when it is in the run (kvcalib.evaluation.longcontext.cells)

Every Result carries the run's `setup` (model, text, windows, seq_len, mode, residual: the window
every recipe was given, or None when each kept its own) and its own residual (None in fake
mode, which quantizes every position: no window) and kept sinks;
`format_table` prints the setup as a header line and full precision as the first row.
"""

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kvcalib.core import data as data_mod
from kvcalib.core.plan import plan_for_model, with_residual
from kvcalib.core.recipe import Recipe, load_recipe
from kvcalib.errors import DataError, NumericsError, RecipeError
from kvcalib.evaluation import longcontext, longreport
from kvcalib.evaluation.external import evaluate_external, external_bits
from kvcalib.evaluation.longcontext import passkey_accuracy
from kvcalib.evaluation.plots import Recorder
from kvcalib.io import atomic
from kvcalib.sim.simulate import Simulator
from kvcalib_runtime.cache.memory import planned_bits
from kvcalib_runtime.cache.scheme import KVParams, KVScheme
from kvcalib_runtime.checkpoint.format import Checkpoint
from kvcalib_runtime.model.geometry import Geometry
from kvcalib_runtime.model.transforms import Transforms


@dataclass
class Result:
    """One recipe's scores (the JSON object `kvcalib eval --json` writes per recipe)."""

    recipe: str
    mode: str
    ppl: float
    ppl_fp: float
    kld: float
    top1: float
    bits_per_element: float
    bits_at_context: dict[str, float]
    residual: int | None
    seconds: float
    passkey: dict[str, float] | None = None
    notes: list[str] = field(default_factory=list)
    sinks: str = "none"
    setup: dict = field(default_factory=dict)
    long_context: dict[str, dict[str, dict[str, float]]] | None = None

    @property
    def delta_ppl(self) -> float:
        return self.ppl - self.ppl_fp

    def to_json(self) -> dict:
        out = asdict(self)
        out["delta_ppl"] = self.delta_ppl
        return out


@dataclass
class Candidate:
    """A recipe ready to run: its scheme, its tensors and where its transforms are (None for
    an external peer, which runs through its own cache)."""

    name: str
    recipe: Recipe | None
    scheme: KVScheme | None
    params: KVParams
    transforms: Transforms | None


class Scores:
    """Running sums over windows for one recipe."""

    def __init__(self):
        self.nll = self.kl = self.agree = 0.0
        self.tokens = 0
        self.seconds = 0.0
        self.notes = []

    def add(self, logits, fp_logp, targets, seconds):
        """logits or log-probs [T, V] of the recipe, fp_logp [T, V], targets [T]."""
        logp = torch.log_softmax(logits.float(), -1)
        self.nll += _nll(logp, targets)
        self.kl += (fp_logp.exp() * (fp_logp - logp)).sum().item()
        self.agree += (logp.argmax(-1) == fp_logp.argmax(-1)).sum().item()
        self.tokens += len(targets)
        self.seconds += seconds


def _nll(logp, targets) -> float:
    return -logp.gather(-1, targets[:, None]).sum().item()


def candidates(
    model, recipes, profile=None, weights: Checkpoint | None = None, residual: int | None = None
) -> list[Candidate]:
    """Plan every recipe (names, paths or Recipe objects) for `model` (or its config: see
    `plan_for_model`, so that recipes are judged before the weights load). On a converted
    checkpoint's weights (`weights`), a recipe quantizes as on the original model: the
    transforms the weights hold and the recipe does not use are undone for it. `residual`
    gives every recipe that residual window (`kvcalib.core.plan.with_residual`)."""
    out = []
    for r in recipes:
        recipe = r if isinstance(r, Recipe) else load_recipe(r)
        if residual is not None:
            recipe = with_residual(recipe, residual)
        if recipe.external:
            if weights is not None and any(t.in_weights for t in weights.transforms.layers):
                raise RecipeError(
                    f"recipe {recipe.name} runs {recipe.external}'s own cache on the weights "
                    "as given, and these hold kvcalib's fused transforms: evaluate it on the "
                    f"source model ({weights.meta['source']['spec']})"
                )
            geometry = Geometry.from_config(getattr(model, "config", model))
            if geometry.sliding:
                raise RecipeError(
                    f"recipe {recipe.name} runs transformers' QuantizedCache, which takes models "
                    f"with full attention layers only, and {geometry.model_type} has "
                    "sliding-window layers: leave it out for this model"
                )
            out.append(Candidate(recipe.name, recipe, None, KVParams(), None))
            continue
        scheme, params = plan_for_model(model, recipe, profile)
        if weights is None:
            transforms = Transforms.online(scheme, params)
        else:
            try:
                transforms, params = Transforms.for_weights(
                    scheme, params, weights.transforms, weights.params
                )
            except ValueError as e:
                raise RecipeError(
                    f"recipe {recipe.name} on {weights.meta['recipe']['name']}'s "
                    f"converted weights: {e}"
                ) from None
        out.append(Candidate(recipe.name, recipe, scheme, params, transforms))
    return out


def score(
    model,
    tokenizer,
    cands: list[Candidate],
    *,
    reference=None,
    data=None,
    seq_len: int = 1024,
    windows: int = 4,
    mode: str = "decode",
    passkey: bool = False,
    long_context: Sequence[int] | None = None,
    long_context_prompts: int = longcontext.PROMPTS,
    plots: str | Path | None = None,
    progress: bool = True,
    report: Callable[[list[Result]], None] | None = None,
) -> list[Result]:
    """Score planned candidates on `windows` windows of `seq_len` tokens of an already loaded
    model (see the module docstring), and on the long-context suite at `long_context` lengths
    when given. `reference`: a model whose logits are full precision instead of `model`'s
    (a converted folder's source model: `evaluate`'s `reference="source"`); the run's setup
    then says "reference": "source". `report(results)` runs before the plots are written, so
    that a plot that fails to write loses no result (the CLI prints its table there)."""

    max_len = getattr(model.config, "max_position_embeddings", None)
    if max_len and seq_len > max_len:
        raise DataError(
            f"--seq-len {seq_len} exceeds the model's context ({max_len} tokens): use at most that"
        )
    longcontext.check_lengths(long_context or (), max_len)
    if passkey:
        longcontext.check_passkey(max_len)
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    ids = data_mod.eval_windows(tokenizer, data, windows=windows, seq_len=seq_len, vocab=vocab)
    ids = ids.to(device)
    scores = {c.name: Scores() for c in cands}
    fp_nll, fp_tokens = 0.0, 0
    recorder = None
    if plots is not None:
        recorder = Recorder(model)
    bar = tqdm(total=windows * len(cands), desc="eval", disable=not progress, leave=False)
    internal = [c for c in cands if c.scheme is not None]
    with torch.no_grad(), bar:  # the bar is cleared before any error prints
        for w in range(windows):
            x = ids[w : w + 1]
            targets = x[0, 1:]
            full = model if reference is None else reference
            fp_logp = torch.log_softmax(full(x).logits[0, :-1].float(), -1)
            _finite(fp_logp, "full precision", w)
            fp_nll += _nll(fp_logp, targets)
            fp_tokens += len(targets)
            if recorder is not None:
                recorder.reference(x)
            for c in internal:
                bar.set_postfix_str(c.name)
                observers = [recorder.observer(c.name)] if recorder is not None else []
                sim = Simulator(
                    model,
                    c.scheme,
                    c.params,
                    mode=mode,
                    transforms=c.transforms,
                    observers=observers,
                )
                start = time.perf_counter()
                logits = sim(x)[0, :-1]
                _finite(logits, f"recipe {c.name}", w)
                scores[c.name].add(logits, fp_logp, targets, time.perf_counter() - start)
                if sim.sink_passes > 1:
                    note = f"window {w}: sinks decided in {sim.sink_passes} passes"
                    scores[c.name].notes.append(note)
                bar.update()
        for c in cands:
            if c.scheme is None:
                bar.set_postfix_str(c.name)
                evaluate_external(model, c.recipe, ids, scores[c.name], bar)
                scores[c.name].notes.append("external peer: decode mode through its own cache")
    ppl_fp = _ppl(fp_nll, fp_tokens, "full precision")
    results = []
    cfg = model.config
    windowed = [c for c in cands if mode == "decode" or c.scheme is None]  # fake: no window
    residuals = {_residual(c) for c in windowed}
    setup = {
        "model": getattr(getattr(model, "kvcalib_source", None), "spec", cfg.name_or_path),
        "data": data_label(data),
        "windows": windows,
        "seq_len": seq_len,
        "mode": mode,
        "residual": residuals.pop() if len(residuals) == 1 else None,
    }
    if reference is not None:
        setup["reference"] = "source"
    for c in cands:
        s = scores[c.name]
        ppl = _ppl(s.nll, s.tokens, f"recipe {c.name}")
        if not math.isfinite(s.kl):
            raise NumericsError(f"recipe {c.name}: its KL divergence is {s.kl}; {_NUMERICS_FIX}")
        bits = _bits(c, cfg, seq_len)
        results.append(
            Result(
                recipe=c.name,
                mode=mode if c.scheme is not None else "decode",
                ppl=ppl,
                ppl_fp=ppl_fp,
                kld=s.kl / s.tokens,
                top1=s.agree / s.tokens,
                bits_per_element=bits[0],
                bits_at_context=bits[1],
                residual=_residual(c) if mode == "decode" or c.scheme is None else None,
                seconds=s.seconds,
                notes=s.notes,
                sinks=_sinks(c),
                setup=setup,
            )
        )
    if passkey:
        for c, r in zip(cands, results, strict=True):
            r.passkey = passkey_accuracy(model, tokenizer, c, progress=progress)
    if long_context:
        cells = longcontext.run(
            model,
            tokenizer,
            cands,
            data=data,
            lengths=long_context,
            prompts=long_context_prompts,
            progress=progress,
        )
        for r, c in zip(results, cells, strict=True):
            r.long_context = c
    if report is not None:
        report(results)
    if plots is not None:
        with atomic.added_files(Path(plots), "--plots"):
            recorder.write(plots)
            if long_context:
                longreport.plot(results, Path(plots) / "long_context.png")
                longreport.plot_probe(results, Path(plots) / "long_context_probe.png")
    return results


_NUMERICS_FIX = (
    "use --dtype float32 if the activations overflow the dtype, else fix the non-finite values "
    "in the weights or the recipe's tensors"
)


def _finite(logits: torch.Tensor, who: str, window: int) -> None:
    """NumericsError when logits [T, V] hold NaN or Inf: never a `ppl nan` in the table."""
    if not bool(torch.isfinite(logits).all()):
        raise NumericsError(f"{who}, window {window}: NaN or Inf in the logits; {_NUMERICS_FIX}")


def _ppl(nll: float, tokens: int, who: str) -> float:
    """exp(nll / tokens), or NumericsError when that is not a finite number."""
    mean = nll / tokens
    if not math.isfinite(mean) or mean > 700:  # exp(700) ~ 1e304: the float range ends here
        raise NumericsError(
            f"{who}: mean NLL {mean:.4g} gives no finite perplexity; {_NUMERICS_FIX}"
        )
    return math.exp(mean)


CONTEXTS = (4096, 32768)  # where bits_at_context is also reported


def data_label(data) -> str:
    """How a run's text is named in its setup: the --data value, or the built-in default."""
    return str(data) if data is not None else "builtin (Python docs, evaluation split)"


def _residual(c: Candidate) -> int:
    return c.scheme.residual if c.scheme is not None else c.recipe.residual


def _sinks(c: Candidate) -> str:
    """The positions a candidate keeps exact besides its residual window."""
    if c.scheme is None or not c.scheme.num_sink_slots:
        return "none"
    parts = [f"first {c.scheme.sinks_first}"] if c.scheme.sinks_first else []
    if c.scheme.sink_budget:
        parts.append(f"{c.scheme.sink_budget} predicted")
    return " + ".join(parts)


def _bits(c: Candidate, cfg, seq_len: int) -> tuple[float, dict[str, float]]:
    """(bits_per_element, bits_at_context) as the module docstring defines them."""
    contexts = sorted({seq_len, *CONTEXTS})
    if c.scheme is None:
        return external_bits(c.recipe, seq_len), {
            str(n): external_bits(c.recipe, n, residual=True) for n in contexts
        }
    geo = Geometry.from_config(cfg)
    sizes = dict(num_layers=geo.layers, kv_heads=geo.kv_heads, head_dim=geo.head_dim)
    bits = {n: planned_bits(c.scheme, c.params, c.transforms, **sizes, context=n) for n in contexts}
    return bits[seq_len][1], {str(n): total for n, (total, _) in bits.items()}


def format_table(results: list[Result]) -> str:
    """A header line with the run's setup, then a Markdown table: recipe, mode, bits/element,
    residual window R (decode rows), kept sinks, ppl, Δppl, KLD, top-1 (and passkey, and the
    long-context accuracy averaged over tasks and lengths); full precision first."""
    with_passkey = any(r.passkey for r in results)
    with_lc = any(r.long_context for r in results)
    head = ["recipe", "mode", "bits/elem", "R", "sinks", "ppl", "Δppl", "KLD", "top-1"]
    head += ["passkey"] if with_passkey else []
    head += ["long-ctx"] if with_lc else []
    rows = [
        setup_line(results[0].setup),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    fp = results[0].ppl_fp
    full = ["full precision", "-", "16.00", "-", "-", f"{fp:.3f}", "+0.000", "0.0000", "1.000"]
    full += ["-"] * (with_passkey + with_lc)
    rows.append("| " + " | ".join(full) + " |")
    for r in results:
        cells = [
            r.recipe,
            r.mode,
            f"{r.bits_per_element:.2f}",
            str(r.residual) if r.mode == "decode" else "-",  # fake mode quantizes everything
            r.sinks,
            f"{r.ppl:.3f}",
            f"{r.delta_ppl:+.3f}",
            f"{r.kld:.4f}",
            f"{r.top1:.3f}",
        ]
        if with_passkey:
            cells.append(
                " ".join(f"{k}:{v:.0%}" for k, v in r.passkey.items()) if r.passkey else "-"
            )
        if with_lc:
            cells.append(f"{longreport.mean_accuracy(r.long_context):.1%}")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def setup_line(setup: dict) -> str:
    """One line naming what a table measured (a Result's `setup`)."""
    residual = setup.get("residual")
    if setup.get("mode") == "fake":
        window = "every position quantized (external peers: decode, column R)"
    elif residual is not None:
        window = f"residual window {residual} for every recipe"
    else:
        window = "each recipe's own residual window (column R)"
    return (
        f"model {setup.get('model')} · text {setup.get('data')} · {setup.get('windows')} windows "
        f"× {setup.get('seq_len')} tokens · {setup.get('mode')} mode · {window}"
    )
