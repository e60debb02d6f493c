"""The `kvcalib` command line: a thin layer that parses options and calls the Python API."""

import signal
import sys

import click

from kvcalib.core import paths  # no torch: paths are checked before the heavy imports
from kvcalib.errors import KvcalibError
from kvcalib.io.atomic import Stopped, stop_signals
from kvcalib_runtime.errors import KvcalibRuntimeError


class _Group(click.Group):
    """Expected failures print one line and exit 2 (a bad option too, as click's own usage
    errors do); Ctrl-C exits 130, SIGTERM 143 and SIGHUP 129, as a shell reports a signal
    (128 + its number), each once what the command staged is removed; anything else keeps its
    traceback."""

    def invoke(self, ctx):
        try:
            with stop_signals():
                return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(128 + signal.SIGINT)
        except Stopped as e:
            click.echo(f"stopped by {e}", err=True)
            sys.exit(128 + e.signum)
        except (KvcalibError, KvcalibRuntimeError) as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except click.UsageError as e:
            name = e.ctx.command_path if e.ctx is not None else "kvcalib"
            message = " ".join(e.format_message().splitlines())
            click.echo(f"error: {message} (see {name} --help)", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.version_option(package_name="kvcalib")
def main():
    """Calibrate, convert and evaluate low-bit KV-cache quantization of LLMs."""


TRUST_REMOTE_CODE = click.option(
    "--trust-remote-code",
    is_flag=True,
    help="Accept a model folder whose config names its own Python code (auto_map).",
)
NO_CALIBRATE = click.option(
    "--no-calibrate",
    is_flag=True,
    help="Without --profile, stop (exit 2) instead of running the default calibration.",
)


def dtype_option(default: str | None, help: str | None = None):
    """The --dtype option of every command that loads weights (kvcalib.core.options.DTYPES's
    names; not imported here, so that `kvcalib --help` does not load torch)."""
    return click.option(
        "--dtype",
        type=click.Choice(["float32", "float16", "bfloat16"]),
        default=default,
        show_default=default is not None,
        help=help,
    )


@main.command()
@click.argument("path", required=False)
@TRUST_REMOTE_CODE
def inspect(path, trust_remote_code):
    """Summarize a model (default: smollm2-135m), a profile folder or a converted folder."""
    paths.check(model=path)
    from kvcalib.inspect import summary

    click.echo(summary(path, trust_remote_code=trust_remote_code))


# Commands defined next to the code they drive. Options whose click name is the API's keyword
# pass through `**options` by name; a command names only the ones it translates.


@main.command("eval")
@click.argument("model", required=False)
@click.option(
    "--recipe",
    "recipes",
    multiple=True,
    help="Preset name (`kvcalib recipes` lists them) or TOML path: a name with a / or ending in "
    ".toml is a file, any other a preset (repeat).",
)
@click.option("--profile", type=click.Path(), help="Calibration profile folder.")
@click.option(
    "--data",
    type=click.Path(),
    help=".txt, .jsonl, builtin:licenses or builtin:chat (default: built-in text).",
)
@click.option("--seq-len", default=1024, show_default=True, help="Tokens per window (>= 2).")
@click.option("--windows", default=4, show_default=True, help="Windows of text (>= 1).")
@click.option("--mode", type=click.Choice(["fake", "decode"]), default="decode", show_default=True)
@click.option(
    "--residual",
    type=click.IntRange(min=0),
    default=None,
    help="Give every recipe this residual window of exact tokens (default: each its own; "
    "decode mode only: fake mode quantizes every position).",
)
@click.option(
    "--reference",
    type=click.Choice(["weights", "source"]),
    default="weights",
    show_default=True,
    help="Full precision for a converted folder: its own weights with an exact cache, or the "
    "source model it was converted from at the same --dtype (the fused rotations' rounding "
    "then counts).",
)
@click.option("--passkey", is_flag=True, help="Also measure passkey retrieval at 1K/2K/4K.")
@click.option(
    "--long-context",
    is_flag=True,
    help="Also run the long-context suite (passkey, multi-key, multi-value, variable tracking, "
    "frequent words) at 2K/4K/8K.",
)
@click.option(
    "--long-context-lengths",
    default=None,
    help="Comma-separated suite lengths in tokens, e.g. 2048,4096 (implies --long-context).",
)
@click.option(
    "--long-context-prompts",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Prompts per task and length (passkey: one per depth, cycling over 5 depths).",
)
@click.option(
    "--session",
    is_flag=True,
    help="Instead: run long chat sessions (a ~1.5K-token system prompt with facts, dozens of "
    "turns, answers kept in the cache) through every recipe at residual 128 (or --residual), "
    "scored per turn against full precision.",
)
@click.option(
    "--sessions",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Seeded sessions with --session.",
)
@click.option(
    "--session-turns",
    type=click.IntRange(min=1),
    default=None,
    help="User turns per session with --session (default 21).",
)
@click.option(
    "--plots", type=click.Path(), help="Write key-error, token-0 and long-context plots here."
)
@click.option("--json", "json_out", type=click.Path(), help="Write the results as JSON.")
@click.option("--device", default="cpu", show_default=True)
@dtype_option("float32")
@NO_CALIBRATE
@TRUST_REMOTE_CODE
def eval_(model, recipes, long_context, long_context_lengths, json_out, no_calibrate, **options):
    """Measure KV recipes against full precision on the same text (MODEL: default
    smollm2-135m, or a converted folder, evaluated with its own side-car). The JSON is a list
    with one object per recipe; each carries the run's setup."""
    paths.check(model=model, data=options["data"], profile=options["profile"], recipes=recipes)
    session = options.pop("session"), options.pop("sessions"), options.pop("session_turns")
    if session[0]:
        _eval_sessions(model, recipes, json_out, no_calibrate, *session[1:], **options)
        return
    import json
    from pathlib import Path

    from kvcalib.api import evaluate
    from kvcalib.core.preflight import inputs
    from kvcalib.evaluation import longreport
    from kvcalib.evaluation.score import format_table
    from kvcalib.io.atomic import check_file_output, file_staging

    if json_out:
        reads = inputs(model, data=options["data"], profile=options["profile"], recipes=recipes)
        check_file_output(Path(json_out), reads, "--json")
    lengths = None
    if long_context_lengths is not None:
        try:
            lengths = [int(n) for n in long_context_lengths.split(",")]
        except ValueError:
            raise click.BadParameter(
                f"{long_context_lengths!r}: give token counts separated by commas, e.g. 2048,4096",
                param_hint="--long-context-lengths",
            ) from None
    elif long_context:
        lengths = True  # the suite's default lengths, named as plain --long-context's

    def show(results):  # the table, before the plots and the JSON are written
        click.echo(format_table(results))
        if lengths:
            click.echo()
            click.echo(longreport.format_table(results))
            if paired := longreport.format_paired(results):
                click.echo()
                click.echo(paired)
        for r in results:
            for note in r.notes:
                click.echo(f"note: {r.recipe}: {note}", err=True)

    results = evaluate(
        model,
        list(recipes),
        long_context=lengths,
        calibrate_missing=not no_calibrate,
        report=show,
        **options,
    )
    if json_out:
        with file_staging(Path(json_out), "--json") as tmp:
            tmp.write_text(json.dumps([r.to_json() for r in results], indent=2))


def _eval_sessions(model, recipes, json_out, no_calibrate, sessions, turns, **options):
    """`kvcalib eval --session`: the session benchmark's tables, its plot under --plots."""
    import json
    from pathlib import Path

    from kvcalib.api import evaluate_sessions
    from kvcalib.evaluation import sessionreport
    from kvcalib.io.atomic import file_staging

    residual = 128 if options["residual"] is None else options["residual"]
    _, scores = evaluate_sessions(
        model,
        list(recipes),
        profile=options["profile"],
        residual=residual,
        sessions=sessions,
        turns=turns,
        device=options["device"],
        dtype=options["dtype"],
        calibrate_missing=not no_calibrate,
        trust_remote_code=options["trust_remote_code"],
    )
    click.echo(f"{sessions} session(s) per recipe, residual {residual}.\n")
    click.echo(sessionreport.report(scores))
    if options["plots"]:
        Path(options["plots"]).mkdir(parents=True, exist_ok=True)
        click.echo(f"plot: {sessionreport.plot(scores, Path(options['plots']) / 'session.png')}")
    if json_out:
        with file_staging(Path(json_out), "--json") as tmp:
            tmp.write_text(json.dumps(scores, indent=1) + "\n")


@main.command("recipes")
def recipes_():
    """List the preset recipes: description and bits per element at 4K tokens on the default
    model's geometry (everything the runtime cache allocates, walked from its buffers). An
    entry of the presets folder that is no preset is named in a warning and left out."""
    from kvcalib.evaluation.listing import format_recipes

    table, warnings = format_recipes()
    click.echo(table)
    for line in warnings:
        click.echo(f"warning: {line}", err=True)


@main.command()
@click.argument("model", required=False)
@click.option("--profile", "profile", default=None, help="Profile folder from kvcalib calibrate.")
@click.option(
    "--recipe",
    required=True,
    help="Preset name or recipe TOML file: a name with a / or ending in .toml is a file, any "
    "other a preset.",
)
@click.option("-o", "--output", required=True, help="Folder to write (atomically).")
@click.option("--force", is_flag=True, help="Replace an existing output folder.")
@dtype_option(None, "dtype of the floating weights written (default: the source's).")
@click.option(
    "--max-shard-size",
    default="5GB",
    show_default=True,
    help="Largest weight file, e.g. 5GB, 500MiB.",
)
@click.option(
    "--rotate-residual",
    is_flag=True,
    help="Also fuse a Hadamard rotation of the residual stream (QuaRot R1).",
)
@click.option(
    "--export",
    type=click.Choice(["vllm-fp8"]),
    default=None,
    help="Add compressed-tensors FP8 KV-cache scales for vLLM (needs --profile).",
)
@NO_CALIBRATE
@TRUST_REMOTE_CODE
def convert(model, no_calibrate, **options):
    """Fuse a recipe's rotations and scalings into MODEL's weights (default: smollm2-135m)."""
    paths.check(model=model, profile=options["profile"], recipes=[options["recipe"]])
    from kvcalib.api import convert as convert_model

    path = convert_model(model, calibrate_missing=not no_calibrate, **options)
    click.echo(f"wrote {path}")


@main.command("calibrate")
@click.argument("model", required=False)
@click.option(
    "-o", "--output", required=True, type=click.Path(), help="Profile folder to write (atomically)."
)
@click.option(
    "--data",
    type=click.Path(),
    default=None,
    help=".txt, .jsonl, builtin:licenses or builtin:chat (default: built-in calibration text).",
)
@click.option("--num-samples", default=16, show_default=True, help="Calibration windows (>= 1).")
@click.option("--seq-len", default=512, show_default=True, help="Tokens per window (>= 16).")
@click.option("--seed", default=0, show_default=True, help="Seed of the window starts (>= 0).")
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    help="cpu, cuda, cuda:N, or auto (spread over every visible GPU; the CPU without one).",
)
@dtype_option("float32")
@click.option("--force", is_flag=True, help="Replace an existing profile folder.")
@click.option(
    "--sequential/--in-memory",
    default=None,
    help="Load one decoder layer at a time from the shards (same profile, for models larger "
    "than memory) or the whole model; default: sequential when the model does not fit.",
)
@click.option(
    "--offload-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="With --sequential: keep activations between layers in files here, not in memory.",
)
@click.option(
    "--sensitivity",
    type=click.Choice(["fisher", "probe", "none"]),
    default="fisher",
    show_default=True,
    help="Per-layer sensitivity for bit allocation: from the gradients the codebooks use "
    "(fisher, nearly free), measured by quantizing each layer in turn (probe, slow), or none "
    "(allocating recipes then use uniform bits).",
)
@click.option(
    "--answer-sensitivity",
    type=click.Choice(["probe", "fisher"]),
    default="probe",
    show_default=True,
    help="The answer-loss sensitivity on retrieval prompts: measured, the answer's likelihood "
    "with each layer's keys or values quantized in turn (probe), or estimated from its gradients "
    "(fisher: a forward and a backward per prompt).",
)
@click.option(
    "--answer-probe",
    type=click.Choice(["screen", "cut", "all"]),
    default="screen",
    show_default=True,
    help="What the probe measures: every tensor at 2 bits and the third with the largest loss "
    "there at 3 bits too (screen), every tensor at 2 and 3 bits (cut), the rest extrapolated by "
    "the text's Fisher sensitivity; or every width (all). On smollm2-135m and qwen2.5-0.5b "
    "kvcalib-2's allocation is the same with each. Its predicted cost is printed before it runs; "
    "measured on smollm2-135m, the screen is 2.2 of the default calibration's 4.7 plain forwards "
    "over its 16 x 512 tokens (docs/models.md).",
)
@click.option(
    "--retrieval-prompts",
    type=click.IntRange(min=0),
    default=None,
    help="Retrieval prompts the answer-loss sensitivity reads, 1,024 tokens each (default 8; the "
    "probe's cost grows with them; 0: none, and no answer loss).",
)
@click.option(
    "--gradient-windows",
    type=click.IntRange(min=1),
    default=None,
    help="Windows with a backward pass, for the sensitivity and the codebooks alike "
    "(default: 4 and 2).",
)
@click.option(
    "--sensitivity-windows",
    type=click.IntRange(min=1),
    default=None,
    help="Windows of the sensitivity (overrides --gradient-windows; default 4).",
)
@click.option(
    "--codebook-windows",
    type=click.IntRange(min=1),
    default=None,
    help="Windows of the codebooks' Fisher weights (overrides --gradient-windows; default 2).",
)
@click.option(
    "--vector-ablation",
    is_flag=True,
    help="Also fit the vector codebooks of the kvcalib-1.5 ablation "
    "(benchmarks/kvcalib-1.5-ablation/), not only those the presets use.",
)
@click.option(
    "--answer-codebooks",
    is_flag=True,
    help="Also fit each preset's scalar codebook on the retrieval prompts' answer loss beside "
    'the text\'s (codebook_weight = "fisher+answer"; benchmarks/answer-codebooks/).',
)
@TRUST_REMOTE_CODE
def calibrate_(
    model,
    output,
    sensitivity,
    answer_sensitivity,
    answer_probe,
    retrieval_prompts,
    gradient_windows,
    sensitivity_windows,
    codebook_windows,
    vector_ablation,
    answer_codebooks,
    **options,
):
    """Profile MODEL's KV cache on calibration text (default: smollm2-135m): ranges, outlier
    channels, attention sinks, sink predictor, sensitivity and codebooks."""
    paths.check(model=model, data=options["data"])
    import dataclasses

    from kvcalib.calibration import PHASES, Settings, calibrate
    from kvcalib.inspect import profile_summary

    default = Settings()
    settings = dataclasses.replace(
        default,
        sensitivity="fisher" if sensitivity == "none" else sensitivity,
        answer_sensitivity=answer_sensitivity,
        answer_probe=answer_probe,
        retrieval_prompts=default.retrieval_prompts
        if retrieval_prompts is None
        else retrieval_prompts,
        sensitivity_windows=sensitivity_windows or gradient_windows or default.sensitivity_windows,
        codebook_windows=codebook_windows or gradient_windows or default.codebook_windows,
        vector_ablation=vector_ablation,
        answer_codebooks=answer_codebooks,
    )
    phases = tuple(p for p in PHASES if p != "sensitivity" or sensitivity != "none")

    profile = calibrate(model, output, phases=phases, settings=settings, **options)
    click.echo(profile_summary(profile.path))
    click.echo(f"wrote {profile.path} (report: {profile.path / 'report.html'})")


@main.command("generate")
@click.argument("converted_dir")
@click.option("--prompt", required=True, help="Text to complete (the question, with --document).")
@click.option(
    "--document",
    default=None,
    help="A text file, or pydoc:TOPIC (Python's built-in documentation), put before the prompt.",
)
@click.option("--max-new-tokens", default=128, show_default=True, help="Tokens to generate.")
@click.option("--device", default=None, help="Torch device (default: cuda if available, else cpu).")
@click.option("--temperature", default=0.0, show_default=True, help="0 is greedy decoding.")
@click.option(
    "--top-p", default=1.0, show_default=True, help="Nucleus mass when sampling, in (0, 1]."
)
@click.option("--chat", is_flag=True, help="Wrap the prompt in the folder's chat template.")
@click.option(
    "--compare-fp16",
    is_flag=True,
    help="Also answer through a full-precision cache (the model's dtype: float32 on CPU) and "
    "print both answers, both caches' speed and memory.",
)
def generate_(
    converted_dir, prompt, document, max_new_tokens, device, temperature, top_p, chat, compare_fp16
):
    """Stream a converted checkpoint's completion of --prompt through its quantized KV cache,
    then print decode speed and the memory the cache allocated."""
    paths.check(checkpoint=converted_dir)
    from kvcalib.generate import format_report, generate_text

    sections = []

    def section(title: str) -> None:  # the streamed answer before it ends without a newline
        click.echo(("\n" if sections else "") + f"--- {title} ---")
        sections.append(title)

    report = generate_text(
        converted_dir,
        prompt,
        max_new_tokens=max_new_tokens,
        device=device,
        temperature=temperature,
        top_p=top_p,
        chat=chat,
        document=document,
        compare=compare_fp16,
        on_text=lambda text: click.echo(text, nl=False),
        on_section=section,
        on_note=lambda line: click.echo(line, err=True),
    )
    click.echo()
    click.echo(format_report(report))


@main.command(
    "lm-eval",
    context_settings={"ignore_unknown_options": True, "help_option_names": []},
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def lm_eval_(args):
    """lm-evaluation-harness's own command line with the `kvcalib` model type registered:
    `kvcalib lm-eval --model kvcalib --model_args pretrained=MODEL,recipe=R --tasks T ...`
    (needs kvcalib[ruler]; `kvcalib lm-eval --help` is lm-eval's help)."""
    try:
        from kvcalib.lmeval import run_cli
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("lm_eval"):
            raise
        raise KvcalibError(
            "kvcalib lm-eval runs lm-evaluation-harness, which is not installed: "
            "pip install 'kvcalib[ruler]'"
        ) from None
    run_cli(args)
