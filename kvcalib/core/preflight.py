"""What each command checks before any work: every option in range, every input readable and
meaning something, every output writable and apart from the inputs, and whatever the model's
config.json alone can refute (a window longer than its context) — all before a model loads.

    source = preflight.calibration(model, output_dir, data=..., num_samples=..., ...)
    preflight.evaluate_options(seq_len=..., windows=..., mode=..., device=..., dtype=..., ...)
    preflight.generate(path, prompt, max_new_tokens=..., temperature=..., top_p=..., device=...)
    inputs = preflight.inputs(model, data=..., profile=..., recipes=...)   # for overlap checks

Each refusal is one line (OptionError, DataError, OutputError, ModelError, ...) naming the input
and the fix, the same from the Python API and from the CLI.
"""

import contextlib
import json
from pathlib import Path

from kvcalib.core import models, options
from kvcalib.core.data import check_data
from kvcalib.core.paths import is_recipe_file
from kvcalib.errors import DataError, ModelError, OptionError
from kvcalib.io import atomic
from kvcalib_runtime.checkpoint.format import META
from kvcalib_runtime.generate import MIN_TEMPERATURE

MODES = ("fake", "decode")
MAX_SEED = 2**63 - 1
MAX_CALIBRATION_TOKENS = 1 << 24  # 2048x the default 16 x 512: beyond reason, not a calibration


def inputs(model=None, *, data=None, profile=None, recipes=()) -> list[Path]:
    """The local files and folders a command reads, without resolving anything: the model's
    folder or .gguf (the embedded default's GGUF; nothing for a hub id), a --data file, a
    profile folder, recipe files."""
    found = []
    if model is None or str(model) == models.DEFAULT_MODEL:
        with contextlib.suppress(ModelError):  # not installed: resolve says so
            found.append(models.default_gguf())
    elif Path(model).expanduser().exists():
        found.append(Path(model).expanduser())
    if data is not None and not str(data).startswith("builtin:"):
        found.append(Path(data))
    if profile is not None and not hasattr(profile, "tensors"):
        found.append(Path(profile))
    files = [Path(r) for r in recipes if isinstance(r, str | Path) and is_recipe_file(r)]
    found += [p for p in files if p.is_file()]
    return found


def calibration(
    model,
    output_dir,
    *,
    data,
    num_samples,
    seq_len,
    seed,
    device,
    dtype,
    force: bool,
    offload_dir,
    trust_remote_code: bool,
) -> models.ModelSource:
    """Check a calibration request; returns the resolved model (nothing is loaded)."""
    options.count("--num-samples", num_samples)
    options.count("--seq-len", seq_len, minimum=16)
    options.count("--seed", seed, minimum=0, maximum=MAX_SEED)
    if (tokens := num_samples * seq_len) > MAX_CALIBRATION_TOKENS:
        raise OptionError(
            f"--num-samples {num_samples} x --seq-len {seq_len} = {tokens} tokens would need "
            f"{tokens * 8 / 2**30:.3g} GiB for their ids alone: use at most "
            f"{MAX_CALIBRATION_TOKENS} tokens (the default is 16 x 512)"
        )
    options.device("--device", device, auto=True)
    options.dtype("--dtype", dtype)
    check_data(data)
    reads = inputs(model, data=data)
    out = Path(output_dir)
    if offload_dir is not None:
        offload = Path(offload_dir)
        if offload.exists() and not offload.is_dir():
            raise OptionError(f"--offload-dir {offload}: a file is there; name a folder")
        atomic.check_writable(offload, "--offload-dir")
        atomic.check_apart(offload, [*reads, out], "folder", "--offload-dir")
    atomic.check_output(out, force, reads, kind="profile")
    source = models.resolve(model, trust_remote_code=trust_remote_code)
    context(source, seq_len)
    return source


def evaluate_options(
    *, seq_len, windows, mode, device, dtype, data, plots, reads, residual=None
) -> None:
    """Check an evaluation request's options, its text and its plots folder."""
    options.count("--seq-len", seq_len, minimum=2)
    options.count("--windows", windows)
    if mode not in MODES:
        raise OptionError(f"--mode {mode!r}: use one of {', '.join(MODES)}")
    if mode == "fake" and residual is not None:
        raise OptionError(
            f"--residual {residual} does not apply to --mode fake, which quantizes every "
            "position (no window): drop --residual, or use --mode decode"
        )
    options.device("--device", device, auto=True)
    options.dtype("--dtype", dtype)
    check_data(data)
    if plots is not None:
        plots = Path(plots)
        if plots.exists() and not plots.is_dir():
            raise OptionError(f"--plots {plots}: a file is there; name a folder for the plots")
        atomic.check_writable(plots, "--plots")
        atomic.check_apart(plots, reads, "folder", "--plots")


def max_positions(source: models.ModelSource) -> int | None:
    """The model's context from its config.json (max_position_embeddings), if it states one."""
    config = json.loads((source.path / "config.json").read_text())
    limit = config.get("max_position_embeddings")
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def context(source: models.ModelSource, seq_len: int) -> None:
    """DataError when windows of `seq_len` tokens exceed the model's context (config.json)."""
    limit = max_positions(source)
    if limit is not None and seq_len > limit:
        raise DataError(
            f"--seq-len {seq_len} exceeds the model's context ({limit} tokens): use at most that"
        )


def generate(path, prompt, *, max_new_tokens, temperature, top_p, device) -> None:
    """Check a generation request before the checkpoint loads: the prompt, the options, and
    that `path` is a converted checkpoint (a profile or a model folder gets the command that
    makes one)."""
    if not isinstance(prompt, str) or not prompt:
        raise OptionError(f"--prompt {prompt!r}: give some text to complete")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise OptionError("--prompt holds bytes that are not UTF-8 text; pass text") from None
    options.count("--max-new-tokens", max_new_tokens)
    options.number("--temperature", temperature, low=0.0)
    if 0 < temperature < MIN_TEMPERATURE:
        raise OptionError(
            f"--temperature {temperature!r} is below what float32 sampling resolves: use 0 "
            f"(greedy) or at least {MIN_TEMPERATURE:.4g}"
        )
    options.number("--top-p", top_p, low=0.0, high=1.0, open_low=True)
    if device is not None:
        options.device("--device", device)
    folder = options.input_path("checkpoint", path)
    if (folder / models.PROFILE).is_file():
        raise ModelError(
            f"{folder}: this is a profile folder (kvcalib calibrate's output), not a converted "
            f"checkpoint: run kvcalib convert MODEL --profile {folder} --recipe R -o OUT, "
            "then kvcalib generate OUT"
        )
    if (folder / "config.json").is_file() and not (folder / META).is_file():
        raise ModelError(
            f"{folder}: a model folder, not a converted checkpoint (no {META}): run kvcalib "
            f"convert {folder} --recipe R -o OUT, then kvcalib generate OUT"
        )
