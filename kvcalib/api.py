"""The public pipeline: `calibrate`, `convert` and `evaluate`, and the default profile that
connects them.

The stages (kvcalib.calibration, kvcalib.conversion, kvcalib.evaluation) never import each other:
a recipe that needs calibrated tensors gets them from here. Given no profile, `convert` and
`evaluate` announce that they use the default calibration of the model (computed once, cached
under the kvcalib cache folder) before they start it, or refuse with `calibrate=False`.

The calibration and evaluation stages are imported where they are used (2.5 s of CPU on import,
more than the conversion module itself): `convert` pays for the conversion alone.
"""

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvcalib.conversion.convert import convert as convert_checkpoint
from kvcalib.core import data as data_mod
from kvcalib.core import options, preflight
from kvcalib.core.models import (
    DEFAULT_MODEL,
    ModelSource,
    cache_dir,
    load_model,
    resolve,
    writable_cache_dir,
)
from kvcalib.core.plan import scheme_with_residual
from kvcalib.core.profile import FORMAT_VERSION, Profile
from kvcalib.core.recipe import Recipe, load_recipe
from kvcalib.errors import OptionError, ProfileError, RecipeError
from kvcalib.io import atomic
from kvcalib_runtime.checkpoint.format import META, read_checkpoint

if TYPE_CHECKING:
    from kvcalib.evaluation.score import Result

__all__ = ["ProfileTerms", "convert", "default_profile", "default_profile_path", "evaluate"]
CONVERTED = "converted checkpoint"  # the kind of output convert writes (atomic.KINDS)

# What the default calibration costs: benchmarks/calibration-cost/smollm2-135m.json, from
# bench_calibrate.py back to back with a plain forward over the same 16 x 512 tokens on 2
# otherwise idle CPU cores (2026-12-06): 76.2 s against 16.2 s (docs/models.md's table; a test
# holds the two equal). Qwen2.5-0.5B's record: 3.5x.
DEFAULT_COST = "76 s on 2 CPU cores for smollm2-135m, 4.7x a plain forward"
OTHER_COST = "3.5-4.7x a plain forward over 16 x 512 tokens on smollm2-135m and qwen2.5-0.5b"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class ProfileTerms:
    """How the caller's user names a profile and the way to stop a default calibration, for
    `default_profile`'s note and refusals: the CLI's options by default (lm-eval's model args
    in kvcalib.lmeval)."""

    missing: str = "no --profile given"
    give: str = "pass --profile DIR"
    stop: str = "--no-calibrate stops here instead"


def default_profile_path(source: ModelSource) -> Path:
    """Where the default calibration of `source` is cached: keyed by the model's fingerprint,
    the profile format and a digest of what a default calibration computes (its settings, the
    codebook variants the presets ask for and the built-in calibration text, which follows
    Python's own documentation), so a stale profile is never reused."""
    from kvcalib.calibration import Settings
    from kvcalib.calibration.codebooks import preset_variants

    text = hashlib.sha256(data_mod.read_text(None, "calibration").encode()).hexdigest()
    what = json.dumps([dataclasses.asdict(Settings()), preset_variants(), text], sort_keys=True)
    key = f"v{FORMAT_VERSION}-{hashlib.sha256(what.encode()).hexdigest()[:8]}"
    return cache_dir() / "profiles" / f"{source.fingerprint[:16]}-{key}"


def default_profile(
    source: ModelSource,
    profile=None,
    *,
    calibrate_missing: bool = True,
    progress: bool = True,
    log: Callable[[str], None] = _stderr,
    terms: ProfileTerms = ProfileTerms(),
) -> Profile:
    """`profile` (a folder or a Profile) checked against `source`; without one, the default
    calibration of `source`, computed once and cached (announced through `log` first, or
    refused with a ProfileError when `calibrate_missing` is False or the model's context is
    shorter than its windows); `terms` name the options in the caller's words."""
    if profile is not None and not isinstance(profile, str | os.PathLike):  # a loaded Profile
        profile.check_model(source)
        return profile
    if profile is not None:
        return Profile.load(profile, source)
    path = default_profile_path(source)
    if not path.is_dir():
        what = (
            f"{terms.missing}: the recipe needs calibrated tensors, so {source.spec} gets "
            f"its default calibration (`kvcalib calibrate`; "
            f"{DEFAULT_COST if source.spec == DEFAULT_MODEL else OTHER_COST}), cached in {path}"
        )
        if not calibrate_missing:
            raise ProfileError(
                f"{what} - but --no-calibrate was given: run kvcalib calibrate "
                f"{source.spec} -o DIR and {terms.give}"
            )
        from kvcalib.calibration import SEQ_LEN, calibrate

        writable_cache_dir()  # where the profile goes: judged before what goes into it
        stated = (source.path / "config.json").is_file()
        limit = preflight.max_positions(source) if stated else None
        if limit is not None and limit < SEQ_LEN:
            raise ProfileError(
                f"{terms.missing}: the recipe needs calibrated tensors, and the default "
                f"calibration reads windows of {SEQ_LEN} tokens, longer than {source.spec}'s "
                f"context of {limit}: run kvcalib calibrate {source.spec} -o DIR --seq-len "
                f"{limit} and {terms.give}"
            )
        log(f"note: {what}; this runs once ({terms.stop})")

        calibrate(str(source.path), path, progress=progress)
    loaded = Profile.load(path)
    loaded.check_model(source)
    return loaded


def convert(
    model: str | os.PathLike | None = None,
    *,
    recipe: str | os.PathLike | Recipe,
    output: str | os.PathLike,
    profile=None,
    calibrate_missing: bool = True,
    trust_remote_code: bool = False,
    **kwargs,
) -> Path:
    """`kvcalib.conversion.convert.convert` with the default profile when the recipe needs one
    and none is given (see `default_profile`, run only once the output is known to be
    writable); `kwargs` as that function takes them."""
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    if profile is None and recipe.needs_profile:
        reads = preflight.inputs(model, recipes=[recipe.source])
        atomic.check_output(Path(output), kwargs.get("force", False), reads, CONVERTED)
        source = resolve(model, trust_remote_code=trust_remote_code)
        profile = default_profile(source, calibrate_missing=calibrate_missing)
    return convert_checkpoint(
        model,
        recipe=recipe,
        output=output,
        profile=profile,
        trust_remote_code=trust_remote_code,
        **kwargs,
    )


def evaluate(
    model=None,
    recipes=(),
    *,
    profile=None,
    data=None,
    seq_len: int = 1024,
    windows: int = 4,
    mode: str = "decode",
    residual: int | None = None,
    reference: str = "weights",
    passkey: bool = False,
    long_context: Sequence[int] | bool | None = None,
    long_context_prompts: int | None = None,
    plots: str | Path | None = None,
    device: str = "cpu",
    dtype: str | torch.dtype = torch.float32,
    progress: bool = True,
    calibrate_missing: bool = True,
    trust_remote_code: bool = False,
    report: "Callable[[list[Result]], None] | None" = None,
) -> "list[Result]":
    """Evaluate recipes (names, paths or Recipe objects) on a model spec or a converted folder.

    A converted folder (one with kvcalib.json) is evaluated with its own side-car as the recipe
    "<name> (converted)", besides any `recipes`, which run as on the original model (the
    transforms its weights hold are undone for them). Recipes that need calibrated tensors use
    `profile` (a folder or a Profile), else the default profile (`default_profile`).
    `residual` gives every recipe, the side-car's too, that residual window (None: each its own;
    kvcalib.core.plan.scheme_with_residual says how flush blocks follow). Every option, recipe,
    profile and the side-car are checked before the model loads. `dtype` is a name ("float32")
    or a torch dtype.
    `reference`: what a converted folder's recipes are scored against: "weights", its own
    weights with an exact cache; "source", the source model it was converted from (its
    kvcalib.json's source spec, checked by fingerprint), loaded at the same `dtype`, so that the
    fused transforms' rounding at that dtype counts in the KL and the perplexity.
    `report(results)` runs before the plots are written (`score`).
    `long_context`: lengths at which to run the long-context suite (e.g. (2048, 4096)), or True
    for its default lengths (`kvcalib.evaluation.longcontext.LENGTHS`), with
    `long_context_prompts` prompts per task and length (None: `longcontext.PROMPTS`).
    """
    from kvcalib.evaluation import longcontext
    from kvcalib.evaluation.score import Candidate, candidates, score

    reads = preflight.inputs(model, data=data, profile=profile, recipes=recipes)
    preflight.evaluate_options(
        seq_len=seq_len,
        windows=windows,
        mode=mode,
        device=device,
        dtype=dtype,
        data=data,
        plots=plots,
        reads=reads,
        residual=residual,
    )
    loaded = [r if isinstance(r, Recipe) else load_recipe(r) for r in recipes]
    source = resolve(model, trust_remote_code=trust_remote_code)
    preflight.context(source, seq_len)
    default_lengths = long_context is True
    long_context = longcontext.LENGTHS if default_lengths else long_context
    context = preflight.max_positions(source)
    longcontext.check_lengths(long_context or (), context, default=default_lengths)
    if passkey:
        longcontext.check_passkey(context)
    ckpt = read_checkpoint(source.path) if (source.path / META).is_file() else None
    if ckpt is None and not recipes:
        raise RecipeError("name at least one --recipe: `kvcalib recipes` lists the presets")
    original = _reference_source(reference, ckpt, model, trust_remote_code)
    if profile is not None or any(r.needs_profile for r in loaded):
        profile = default_profile(
            source, profile, calibrate_missing=calibrate_missing, progress=progress
        )
    cands = []
    if ckpt is not None:
        name = f"{ckpt.meta['recipe']['name']} (converted)"
        scheme = ckpt.scheme
        if residual is not None:
            scheme = scheme_with_residual(scheme, residual, name)
        cands.append(Candidate(name, None, scheme, ckpt.params, ckpt.transforms))
    config = json.loads((source.path / "config.json").read_text())
    # every recipe planned before the load
    cands += candidates(config, loaded, profile, ckpt, residual=residual)
    net, tokenizer = load_model(
        model,
        device=device,
        dtype=options.dtype("--dtype", dtype),
        trust_remote_code=trust_remote_code,
    )
    if original is not None:
        original = load_model(
            original.path,
            device=device,
            dtype=options.dtype("--dtype", dtype),
            trust_remote_code=trust_remote_code,
        )[0]
    return score(
        net,
        tokenizer,
        cands,
        reference=original,
        data=data,
        seq_len=seq_len,
        windows=windows,
        mode=mode,
        passkey=passkey,
        long_context=long_context,
        long_context_prompts=(
            longcontext.PROMPTS if long_context_prompts is None else long_context_prompts
        ),
        plots=plots,
        progress=progress,
        report=report,
    )


def _reference_source(reference, ckpt, model, trust_remote_code):
    """The source model a converted folder is scored against (`evaluate`'s `reference`), or
    None for its own weights."""
    if reference not in ("weights", "source"):
        raise OptionError(f"--reference {reference!r}: use weights or source")
    if reference == "weights":
        return None
    if ckpt is None:
        raise OptionError(
            f"--reference source scores a converted folder against its source model, and "
            f"{model or 'the default model'} is not a converted folder: drop --reference"
        )
    spec = ckpt.meta["source"]["spec"]
    source = resolve(spec, trust_remote_code=trust_remote_code)
    if source.fingerprint != ckpt.meta["source"]["fingerprint"]:
        raise OptionError(
            f"--reference source: {spec} is not the model {model} was converted from (its "
            "fingerprint differs): evaluate with --reference weights, or restore that model"
        )
    return source


def evaluate_sessions(
    model=None,
    recipes=(),
    *,
    profile=None,
    residual: int | None = 128,
    sessions: int = 2,
    turns: int | None = None,
    device: str = "cpu",
    dtype: str | torch.dtype = torch.float32,
    calibrate_missing: bool = True,
    trust_remote_code: bool = False,
) -> tuple[dict, dict]:
    """Run `sessions` seeded chat sessions of `turns` user turns (`kvcalib.evaluation.session`)
    through every recipe's cache on the original model, fp16 always among them (every score is
    paired against it): ({seed: {recipe: record}}, {recipe: per-turn scores}, as
    `sessionreport.scores` computes them)."""
    from kvcalib.evaluation import session, sessionreport
    from kvcalib.evaluation.score import candidates

    if sessions < 1:
        raise OptionError(f"--sessions {sessions}: run at least one session")
    turns = session.TURNS if turns is None else turns
    if turns < session.PROBE_EVERY:
        raise OptionError(
            f"--session-turns {turns}: a session asks for a fact every {session.PROBE_EVERY} "
            f"turns; use at least {session.PROBE_EVERY}"
        )
    preflight.inputs(model, profile=profile, recipes=recipes)
    loaded = [r if isinstance(r, Recipe) else load_recipe(r) for r in recipes]
    if "fp16" not in [r.name for r in loaded]:
        loaded.insert(0, load_recipe("fp16"))
    source = resolve(model, trust_remote_code=trust_remote_code)
    if (source.path / META).is_file():
        raise RecipeError(
            f"--session runs recipes on the original model, and {model} is a converted folder: "
            f"pass its source model ({read_checkpoint(source.path).meta['source']['spec']})"
        )
    if profile is not None or any(r.needs_profile for r in loaded):
        profile = default_profile(source, profile, calibrate_missing=calibrate_missing)
    config = json.loads((source.path / "config.json").read_text())
    cands = candidates(config, loaded, profile, residual=residual)
    net, tokenizer = load_model(
        model,
        device=device,
        dtype=options.dtype("--dtype", dtype),
        trust_remote_code=trust_remote_code,
    )
    records = {}
    with torch.no_grad():
        for seed in range(sessions):
            s = session.generate(tokenizer, seed, turns=turns)
            records[seed] = {c.name: session.run_session(net, tokenizer, c, s) for c in cands}
    return records, {c.name: sessionreport.scores(records, c.name) for c in cands}
