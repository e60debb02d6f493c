"""`kvcalib eval`: measure KV recipes against full precision on the same windows, in one run.

For every window the full-precision model runs once; every recipe then runs through the
Simulator (fake or decode mode) on the same tokens, and is scored against it:

    ppl       exp(mean next-token NLL) of the recipe; ppl_fp the same for full precision
    kld       mean per-token KL(p_fp || p_recipe) in nats
    top1      fraction of positions whose argmax agrees with full precision
    bits_per_element   storage of everything outside the residual window (codes, metadata,
              codebooks, outliers, sink slots) per element, at the evaluated context;
              bits_with_residual counts the exact residual window too
"""

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvcalib import data as data_mod
from kvcalib.errors import DataError, RecipeError
from kvcalib.models import head_dim
from kvcalib.plan import plan_for_model
from kvcalib.recipe import Recipe, load_recipe
from kvcalib.simulate import Simulator
from kvcalib_runtime.scheme import KVParams, KVScheme, storage_bits


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
    bits_with_residual: float
    residual: int
    seconds: float
    passkey: dict[str, float] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def delta_ppl(self) -> float:
        return self.ppl - self.ppl_fp

    def to_json(self) -> dict:
        out = asdict(self)
        out["delta_ppl"] = self.delta_ppl
        return out


@dataclass
class Candidate:
    """A recipe ready to run: its scheme and tensors, and what the weights already contain."""

    name: str
    recipe: Recipe | None
    scheme: KVScheme | None
    params: KVParams
    fused: frozenset = frozenset()


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


def candidates(model, recipes, profile=None, fused=frozenset()) -> list[Candidate]:
    """Plan every recipe (names, paths or Recipe objects) for `model`."""
    out = []
    for r in recipes:
        recipe = r if isinstance(r, Recipe) else load_recipe(r)
        if recipe.external:
            out.append(Candidate(recipe.name, recipe, None, KVParams()))
            continue
        scheme, params = plan_for_model(model, recipe, profile)
        out.append(Candidate(recipe.name, recipe, scheme, params, frozenset(fused)))
    return out


def evaluate(
    model=None,
    recipes=(),
    *,
    profile=None,
    data=None,
    seq_len: int = 1024,
    windows: int = 4,
    mode: str = "decode",
    passkey: bool = False,
    plots: str | Path | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    trust_remote_code: bool = False,
) -> list[Result]:
    """Evaluate recipes (names, paths or Recipe objects) on a model spec or a converted folder.

    A converted folder (one with kvcalib.json) is evaluated with its own side-car as the recipe
    "<name> (converted)", besides any `recipes`. Recipes that need calibrated tensors use
    `profile` (a folder); without one the model is calibrated first on the built-in
    calibration text, once, and the profile is cached.
    """
    from kvcalib.models import load_model, resolve

    source = resolve(model, trust_remote_code=trust_remote_code)
    net, tokenizer = load_model(
        model, device=device, dtype=dtype, trust_remote_code=trust_remote_code
    )
    cands = []
    if (source.path / "kvcalib.json").is_file():
        from kvcalib_runtime.format import read_checkpoint

        ckpt = read_checkpoint(source.path)
        name = f"{ckpt.meta['recipe']['name']} (converted)"
        cands.append(Candidate(name, None, ckpt.scheme, ckpt.params, ckpt.fused))
    elif not recipes:
        raise RecipeError("name at least one --recipe (see `kvcalib eval --help` for presets)")
    loaded = [r if isinstance(r, Recipe) else load_recipe(r) for r in recipes]
    if any(r.needs_profile for r in loaded):
        from kvcalib.profile import ensure_profile

        profile = ensure_profile(source, profile, progress=progress)
    fused = cands[0].fused if cands else frozenset()
    cands += candidates(net, loaded, profile, fused)
    return score(
        net,
        tokenizer,
        cands,
        data=data,
        seq_len=seq_len,
        windows=windows,
        mode=mode,
        passkey=passkey,
        plots=plots,
        progress=progress,
    )


def score(
    model,
    tokenizer,
    cands: list[Candidate],
    *,
    data=None,
    seq_len: int = 1024,
    windows: int = 4,
    mode: str = "decode",
    passkey: bool = False,
    plots: str | Path | None = None,
    progress: bool = True,
) -> list[Result]:
    """Score planned candidates on `windows` windows of `seq_len` tokens of an already loaded
    model (see the module docstring)."""
    from tqdm.auto import tqdm

    max_len = getattr(model.config, "max_position_embeddings", None)
    if max_len and seq_len > max_len:
        raise DataError(
            f"--seq-len {seq_len} exceeds the model's context ({max_len} tokens): use at most that"
        )
    device = next(model.parameters()).device
    ids = data_mod.eval_windows(tokenizer, data, windows=windows, seq_len=seq_len).to(device)
    scores = {c.name: Scores() for c in cands}
    fp_nll, fp_tokens = 0.0, 0
    recorder = None
    if plots is not None:
        from kvcalib.evalplots import Recorder

        recorder = Recorder(model)
    bar = tqdm(total=windows * len(cands), desc="eval", disable=not progress, leave=False)
    internal = [c for c in cands if c.scheme is not None]
    with torch.no_grad():
        for w in range(windows):
            x = ids[w : w + 1]
            targets = x[0, 1:]
            fp_logp = torch.log_softmax(model(x).logits[0, :-1].float(), -1)
            fp_nll += _nll(fp_logp, targets)
            fp_tokens += len(targets)
            if recorder is not None:
                recorder.reference(x)
            for c in internal:
                bar.set_postfix_str(c.name)
                observers = [recorder.observer(c.name)] if recorder is not None else []
                sim = Simulator(
                    model, c.scheme, c.params, mode=mode, fused=c.fused, observers=observers
                )
                start = time.perf_counter()
                logits = sim(x)[0, :-1]
                scores[c.name].add(logits, fp_logp, targets, time.perf_counter() - start)
                if sim.sink_passes > 1:
                    note = f"window {w}: sinks decided in {sim.sink_passes} passes"
                    scores[c.name].notes.append(note)
                bar.update()
        for c in cands:
            if c.scheme is None:
                from kvcalib.external import evaluate_external

                bar.set_postfix_str(c.name)
                evaluate_external(model, c.recipe, ids, scores[c.name], bar)
                scores[c.name].notes.append("external peer: decode mode through its own cache")
    ppl_fp = math.exp(fp_nll / fp_tokens)
    bar.close()
    results = []
    cfg = model.config
    for c in cands:
        s = scores[c.name]
        bits = _bits(c, cfg, seq_len)
        results.append(
            Result(
                recipe=c.name,
                mode=mode if c.scheme is not None else "decode",
                ppl=math.exp(s.nll / s.tokens),
                ppl_fp=ppl_fp,
                kld=s.kl / s.tokens,
                top1=s.agree / s.tokens,
                bits_per_element=bits[0],
                bits_with_residual=bits[1],
                residual=c.scheme.residual if c.scheme else c.recipe.residual,
                seconds=s.seconds,
                notes=s.notes,
            )
        )
    if passkey:
        from kvcalib.passkey import passkey_accuracy

        for c, r in zip(cands, results, strict=True):
            r.passkey = passkey_accuracy(model, tokenizer, c, progress=progress)
    if recorder is not None:
        recorder.write(plots)
    return results


def _bits(c: Candidate, cfg, seq_len: int) -> tuple[float, float]:
    """(bits per element outside the residual window, bits per element of the whole cache)."""
    if c.scheme is None:
        from kvcalib.external import external_bits

        return external_bits(c.recipe, cfg, seq_len)
    hkv, d = cfg.num_key_value_heads, head_dim(cfg)
    fraction = max(
        (
            t.outliers
            for layer in c.scheme.layers
            for t in (layer.key, layer.value)
            if t is not None and t.granularity == "static"
        ),
        default=0.0,
    )
    b = storage_bits(c.scheme, hkv, d, seq_len, outlier_fraction=fraction)
    total_elements = b["body_elements"] + b["residual_elements"]
    outside = (b["body"] + b["sinks"]) / b["body_elements"] if b["body_elements"] else 16.0
    return outside, (b["body"] + b["sinks"] + b["residual"]) / total_elements


def format_table(results: list[Result]) -> str:
    """A Markdown table: recipe, bits/element, ppl, Δppl, KLD, top-1 (and passkey)."""
    with_passkey = any(r.passkey for r in results)
    head = ["recipe", "mode", "bits/elem", "ppl", "Δppl", "KLD", "top-1"]
    head += ["passkey"] if with_passkey else []
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [
            r.recipe,
            r.mode,
            f"{r.bits_per_element:.2f}",
            f"{r.ppl:.3f}",
            f"{r.delta_ppl:+.3f}",
            f"{r.kld:.4f}",
            f"{r.top1:.3f}",
        ]
        if with_passkey:
            cells.append(
                " ".join(f"{k}:{v:.0%}" for k, v in r.passkey.items()) if r.passkey else "-"
            )
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
