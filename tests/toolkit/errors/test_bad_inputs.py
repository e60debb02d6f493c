"""The bad-input corpus, part 1: `kvcalib calibrate` and `kvcalib convert`.

Every row is answered with exit 2 and one line that names the input and a fix (no traceback),
writes nothing, changes no input (every byte under the case's folder is hashed before and
after), and — where the input can be judged without the model — is answered before any model
or weight loads (the loaders are patched to fail the test if they run): `corpus.check`.

Classes: output (an output over an input, unwritable, of another kind), numbers (non-finite or
inconsistent numbers: profile, recipe, config against its weights, tokenizer against its
vocabulary), options (out of range, unknown devices), size (allocations beyond the context),
deferred (what the runtime could not serve, refused by convert), special (FIFOs, non-UTF-8,
deep JSON, folders for files), hint (a folder of the wrong kind, named as such).
Part 2 (eval, generate, inspect) is test_bad_inputs_run.py, part 3 (side-cars, the runtime's
load) test_bad_side_cars.py.
"""

import pytest
from support.corpus import (
    STATIC,
    TEXT,
    Case,
    Workspace,
    check,
    codebook,
    config,
    config_bytes,
    deep,
    meta,
    out,
    profile_fifo,
    profile_file,
    quantiles,
    recipe_file,
    the_profile,
)
from support.tiny import save_with_tokenizer, tiny_model


def vocab_100(ctx: Workspace):
    """A model of 100 embedding rows with the others' 128-token tokenizer."""
    model = save_with_tokenizer(tiny_model("llama", vocab_size=100), ctx.root / "v100")
    (model / "tokenizer.json").write_bytes((ctx.fixtures.src / "tokenizer.json").read_bytes())
    return model


def added_token(ctx: Workspace):
    """A model of 100 embedding rows whose tokenizer adds "<x>" as id 100, past them."""
    from tokenizers import Tokenizer

    model = save_with_tokenizer(tiny_model("llama", vocab_size=100), ctx.root / "added")
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    tokenizer.add_special_tokens(["<x>"])
    tokenizer.save(str(model / "tokenizer.json"))
    return model


def bad_tokenizer(ctx: Workspace):
    """The model copy with a tokenizer.json the tokenizers library cannot read."""
    (ctx.src / "tokenizer.json").write_text("{")
    return ctx.src


def head_dim_10(ctx: Workspace):
    """A model whose heads (10 channels) have no Hadamard matrix."""
    net = tiny_model("llama", hidden_size=40, num_attention_heads=4, num_key_value_heads=2)
    return save_with_tokenizer(net, ctx.root / "hd10")


def cut_sink_flags(ctx: Workspace):
    """A profile whose sinks.flags holds the first of its two windows."""
    return ctx.profile_tensors(lambda t: t.update({"sinks.flags": t["sinks.flags"][:1]}))


def calib(*args, data=True, model=None):
    """calibrate (the model copy, or `model(ctx)`) on small windows with `args`, where a
    callable argument gets the workspace."""

    def build(ctx):
        base = [model(ctx) if model else ctx.src, "--num-samples", "2", "--seq-len", "32"]
        base += ["--data", ctx.file("t.txt")] if data else []
        return base + [a(ctx) if callable(a) else a for a in args]

    return build


def conv(*args, recipe="per-token-4", profile=None, model=None, output=out):
    """convert the model copy (or `model(ctx)`) with `recipe` (a preset, text for a recipe
    file, or a callable making one) and `profile(ctx)` into `output(ctx)`."""

    def build(ctx):
        name = recipe(ctx) if callable(recipe) else recipe
        name = ctx.recipe(name) if "\n" in str(name) else name
        base = [model(ctx) if model else ctx.src, "--recipe", name, "-o", output(ctx)]
        base += ["--profile", profile(ctx)] if profile else []
        return base + [a(ctx) if callable(a) else a for a in args]

    return build


CALIBRATE = [
    Case("options", "calibrate", calib("--seq-len", "-5", "-o", out), "--seq-len -5: use an"),
    Case("options", "calibrate", calib("--seq-len", "0", "-o", out), "--seq-len 0: use an"),
    Case("options", "calibrate", calib("--num-samples", "0", "-o", out), "--num-samples 0"),
    Case("options", "calibrate", calib("--num-samples", "-3", "-o", out), "--num-samples -3"),
    Case("options", "calibrate", calib("--seed", "-1", "-o", out), "--seed -1: use an"),
    Case("options", "calibrate", calib("--device", "tpu", "-o", out), "--device tpu: not a"),
    Case("options", "calibrate", calib("--device", "cuda:7", "-o", out), "--device cuda:7"),
    Case("options", "calibrate", calib("--dtype", "float8", "-o", out), "'--dtype'"),
    Case("options", "calibrate", calib("--seq-len", "abc", "-o", out), "'--seq-len'"),
    Case("size", "calibrate", calib("--seq-len", "512", "-o", out), "context (256 tokens)"),
    Case(
        "size",
        "calibrate",
        lambda c: [c.src, "--num-samples", "1000000000", "--seq-len", "64", "-o", out(c)],
        "= 64000000000 tokens would need 477 GiB for their ids alone",
    ),
    Case("output", "calibrate", calib("-o", lambda c: c.src, "--force"), "is a model folder, not"),
    Case("output", "calibrate", calib("-o", lambda c: c.src / "sub", "--force"), "overlaps"),
    Case("output", "calibrate", calib("-o", lambda c: c.file("f")), "is a file or a link"),
    Case("output", "calibrate", calib("-o", lambda c: c.file("f") / "p"), "is a file, not a"),
    Case("output", "calibrate", calib("-o", lambda c: c.root, "--force"), "of other files"),
    Case(
        "output",
        "calibrate",
        calib("-o", out, "--offload-dir", lambda c: c.file("f")),
        "--offload-dir",
    ),
    Case(
        "output",
        "calibrate",
        calib("-o", out, "--offload-dir", lambda c: c.src / "act"),
        "overlaps the input",
    ),
    Case("hint", "calibrate", calib("-o", lambda c: c.converted), "a converted checkpoint, not"),
    Case("hint", "calibrate", calib("-o", lambda c: c.converted, "--force"), "pick another"),
    Case("hint", "calibrate", lambda c: [c.profile, "-o", out(c)], "this is a profile folder"),
    Case("special", "calibrate", lambda c: [c.fifo("m"), "-o", out(c)], "a FIFO, socket"),
    Case(
        "special",
        "calibrate",
        calib("--data", lambda c: c.fifo(), "-o", out, data=False),
        "not a regular file",
    ),
    Case(
        "special",
        "calibrate",
        calib("--data", lambda c: c.file("d.jsonl", b'{"text": "\xff"}\n'), "-o", out, data=0),
        "not UTF-8 text",
    ),
    Case(
        "special",
        "calibrate",
        calib(
            "--data",
            lambda c: c.file("l1.txt", "na\xefve ".encode("latin-1") * 99),
            "-o",
            out,
            data=0,
        ),
        "not UTF-8 text (byte 2)",
    ),
    Case(
        "special",
        "calibrate",
        calib("--data", lambda c: c.file("u16.txt", TEXT.encode("utf-16")), "-o", out, data=0),
        "not UTF-8 text (byte 0)",
    ),
    Case(
        "special",
        "calibrate",
        calib("--data", lambda c: c.file("u16.txt", TEXT.encode("utf-16-le")), "-o", out, data=0),
        "holds NUL characters (UTF-16 text?); save the file as UTF-8",
    ),
    Case(
        "special",
        "calibrate",
        calib("--data", lambda c: c.file("d.jsonl", deep()), "-o", out, data=False),
        "nests JSON too deeply",
    ),
    Case(
        "special",
        "calibrate",
        calib("--data", lambda c: c.file("d.jsonl", "[1]\n"), "-o", out, data=False),
        'no string "text" field',
    ),
    Case(
        "special",
        "calibrate",
        calib("--data", lambda c: c.file("d.csv"), "-o", out, data=False),
        "unknown suffix '.csv'",
    ),
    Case(
        "special",
        "calibrate",
        calib("--data", lambda c: c.folder("dir.txt"), "-o", out, data=False),
        "not a regular file",
    ),
    Case(
        "special",
        "calibrate",
        calib("--data", "builtin:nope", "-o", out, data=False),
        "unknown built-in text",
    ),
    Case(
        "special",
        "calibrate",
        calib("--data", lambda c: c.file("e.txt", "  \n"), "-o", out, data=False),
        "holds no text",
    ),
    Case(
        "special",
        "calibrate",
        calib("-o", out, model=lambda c: config_bytes(c, deep().encode())),
        "config.json is not valid JSON",
    ),
    Case(
        "special",
        "calibrate",
        calib("-o", out, model=lambda c: config_bytes(c, b'{"model_type": "\xff"}')),
        "config.json is not valid JSON",
    ),
    Case(
        "numbers",
        "calibrate",
        calib("-o", out, model=lambda c: config(c, num_hidden_layers=3)),
        "config.json has 3 layers, but the weights hold no model.layers.2",
    ),
    Case(
        "numbers",
        "calibrate",
        calib("-o", out, model=lambda c: config(c, num_hidden_layers=1)),
        "the weights hold layer 1, but config.json has 1 layers",
    ),
    Case(
        "numbers",
        "calibrate",
        calib("-o", out, model=lambda c: config(c, num_key_value_heads=4)),
        "k_proj.weight has shape [32, 64], config.json implies [64, 64]",
    ),
    Case(
        "numbers",
        "calibrate",
        calib("-o", out, model=lambda c: config(c, hidden_size=True)),
        "hidden_size = True; expected a positive integer",
    ),
    Case(
        "numbers",
        "calibrate",
        calib(
            "--data",
            lambda c: c.file("x.txt", "<x> ab " * 40),
            "-o",
            out,
            data=False,
            model=added_token,
        ),
        "tokenizes to id 100, past the model's 100 embedding rows",
        before_load=False,
    ),
    Case(
        "numbers",
        "calibrate",
        calib("-o", out, model=vocab_100),
        "its tokenizer has 128 tokens, but config.json's vocab_size is 100",
    ),
]

CONVERT = [
    Case("numbers", "convert", conv(recipe=STATIC, profile=quantiles(float("nan"))), "NaN or Inf"),
    Case(
        "numbers",
        "convert",
        conv(recipe=STATIC, profile=quantiles(float("inf"), "value.all.absmax")),
        "tensor value.all.absmax holds 1 NaN or Inf",
    ),
    Case(
        "numbers",
        "convert",
        conv(profile=meta(quantile_levels=[1.0, 0.0])),
        "quantile_levels [1.0, 0.0] are not the sorted levels",
    ),
    Case(
        "numbers",
        "convert",
        conv(profile=codebook(lambda t: t.flip(-1))),
        "codebook levels are not sorted",
    ),
    Case(
        "numbers",
        "convert",
        conv(profile=codebook(lambda t: t[:, :-1])),
        "profile.json implies",
    ),
    Case(
        "numbers",
        "convert",
        conv(profile=codebook(lambda t: t * 3)),
        "leave the normalized domain",
    ),
    Case(
        "numbers",
        "convert",
        conv(profile=meta(sink_predictor={"layer": 0, "dims": [64], "threshold": 1.0})),
        "sink_predictor.dims [64] are not distinct dims in [0, 64)",
    ),
    Case(
        "numbers",
        "convert",
        conv(profile=meta(sink_predictor={"layer": 0, "dims": [1], "threshold": float("nan")})),
        "sink_predictor.threshold = nan",
    ),
    Case(
        "numbers",
        "convert",
        conv(profile=meta(sink_predictor={"layer": 2, "dims": [1], "threshold": 1.0})),
        "sink_predictor.layer = 2 is not a layer",
    ),
    Case(
        "numbers",
        "convert",
        conv(profile=lambda c: c.profile_json(lambda m: m.update(layers=m["layers"][:1]))),
        "layers holds 1 entries for the model's 2 layers",
    ),
    Case(
        "numbers",
        "convert",
        conv(profile=meta(**{"codebooks.bins": -5})),
        "codebooks.bins = -5 is not a positive integer",
    ),
    Case(
        "numbers",
        "convert",
        conv(profile=meta(**{"massive.ratio": float("nan")})),
        "profile.json massive.ratio = nan is not a finite number",
    ),
    Case(
        "numbers",
        "convert",
        conv(profile=lambda c: c.profile_json(lambda m: m["layers"][1].update(token0_sink=1e999))),
        "profile.json layers[1].token0_sink = inf is not a finite number",
    ),
    Case(
        "numbers",
        "convert",
        conv(profile=meta(**{"model.n_layers": 2})),
        "profile.json has an unknown key model.n_layers",
    ),
    Case("numbers", "convert", conv(profile=meta(colour=1)), "has an unknown key colour"),
    Case(
        "numbers",
        "convert",
        conv(profile=lambda c: c.profile_json(lambda m: m["layers"][0].update(heat=1))),
        "has an unknown key layers[0].heat",
    ),
    Case(
        "numbers",
        "convert",
        conv(profile=lambda c: c.profile_tensors(lambda t: t["attention.token0"].mul_(0.5))),
        "profile.safetensors is not the one profile.json was written with",
    ),
    Case(
        "numbers",
        "convert",
        conv(profile=cut_sink_flags),
        "tensor sinks.flags is torch.uint8 [1, 32], profile.json implies torch.uint8 [2, 32]",
    ),
    Case("numbers", "convert", conv(profile=meta(**{"model.num_layers": 2.0})), "= 2.0 is not"),
    Case("numbers", "convert", conv(profile=meta(**{"model.head_dim": True})), "= True is not"),
    Case("numbers", "convert", conv(profile=meta(seq_len=33)), "windows.input_ids is not int64"),
    Case(
        "numbers",
        "convert",
        conv(profile=meta(probe={"bits": ["2"]})),
        "probe.bits = ['2'] is not a list",
    ),
    Case("special", "convert", conv(profile=profile_file("profile.json", deep())), "not valid"),
    Case("special", "convert", conv(profile=profile_fifo("profile.json")), "not a regular file"),
    Case("special", "convert", conv(profile=profile_fifo("profile.safetensors")), "not a regular"),
    Case("special", "convert", conv(recipe=lambda c: c.fifo("r.toml")), "not a regular file"),
    Case("special", "convert", conv(recipe=recipe_file(b'name = "\xff"')), "not valid TOML"),
    Case("special", "convert", conv(recipe=lambda c: c.folder("r.toml")), "not a regular file"),
    Case(
        "size",
        "convert",
        conv(recipe='name = "r"\nresidual = 1099511627776\n'),
        "residual = 1099511627776 tokens: use 0 to",
    ),
    Case(
        "size",
        "convert",
        conv(recipe='name = "r"\nresidual = 100000\n[key]\nbits = 4\n'),
        "beyond the model's context of 256 tokens",
    ),
    Case(
        "size",
        "convert",
        conv(recipe='name = "r"\n[sinks]\nfirst = 1000000000000\n'),
        "sinks.first = 1000000000000 tokens",
    ),
    Case(
        "size",
        "convert",
        conv(recipe='name = "r"\n[sinks]\nfirst = 300\n'),
        "sinks_first + sink_budget = 300 asks for sink slots",
    ),
    Case(
        "numbers",
        "convert",
        conv(recipe='name = "r"\n[key]\nbits = 2\n[[layers]]\nindex = 5\nkey = {bits = 4}\n'),
        "[[layers]] index 5 names a layer the model does not have; it has 2",
    ),
    Case(
        "numbers",
        "convert",
        conv(
            recipe=STATIC + '[[layers]]\nindex = 1\nkey = {rotation = "hadamard"}\n',
            profile=the_profile,
        ),
        "layers 1: key.rotation = 'hadamard' is the online rotation after RoPE",
    ),
    Case(
        "numbers",
        "convert",
        conv(
            recipe=STATIC
            + '[[layers]]\nindex = 0\nkey = {rotation = "hadamard", position = "post_rope"}\n',
            profile=the_profile,
        ),
        "layers 0: key: static ranges are calibrated unrotated",
    ),
    Case(
        "numbers",
        "convert",
        conv(recipe='name = "r"\n[[layers]]\nindex = "3-1"\n'),
        "use layer indices in [0, 4096)",
    ),
    Case(
        "numbers",
        "convert",
        conv(recipe='name = "r"\n[[layers]]\nindex = -1\n'),
        "use layer indices in [0, 4096)",
    ),
    Case(
        "numbers",
        "convert",
        conv(recipe='name = "r"\n[key]\nbits = 2\n[allocation]\nbudget = 3\nchoices = [2, 7]\n'),
        "at 7 bits, bits = 7 is not supported",
    ),
    Case(
        "numbers",
        "convert",
        conv(recipe='name = "r"\n[key]\nbits = 2\nflush = -1\n'),
        "'key.flush' = -1",
    ),
    Case(
        "numbers",
        "convert",
        conv(recipe='name = "r"\n[key]\nbits = 2\nclip = nan\n'),
        "clip = nan must be a finite number",
    ),
    Case(
        "numbers",
        "convert",
        conv(recipe='name = "r"\n[key]\nbits = 2\nsmooth = inf\n'),
        "key.smooth = inf: use an exponent",
    ),
    Case("numbers", "convert", conv(recipe='name = ""\n'), "'name' must be a non-empty"),
    Case(
        "output",
        "convert",
        conv("--force", output=lambda c: c.src),
        "is a model folder, not a converted checkpoint",
    ),
    Case(
        "output",
        "convert",
        conv("--force", output=lambda c: c.profile),
        "is a profile, not a converted checkpoint",
    ),
    Case(
        "output",
        "convert",
        conv(
            "--force",
            recipe=lambda c: c.recipe(STATIC, "rd/r.toml"),
            profile=the_profile,
            output=lambda c: c.root / "rd",
        ),
        "a folder of other files",
    ),
    Case(
        "output",
        "convert",
        conv("--force", output=lambda c: c.src / "inside"),
        "overlaps",
    ),
    Case("options", "convert", conv("--dtype", "float64"), "'--dtype'"),
    Case("options", "convert", conv("--max-shard-size", "0"), "--max-shard-size '0'"),
    Case("options", "convert", conv("--max-shard-size", "0.0000001B"), "--max-shard-size"),
    Case("options", "convert", conv("--export", "tgi"), "'--export'"),
    Case(
        "hint",
        "convert",
        conv(model=lambda c: c.converted, recipe="fp16"),
        "already a kvcalib-converted checkpoint",
    ),
    Case("hint", "convert", conv(model=the_profile, recipe="fp16"), "this is a profile folder"),
    Case(
        "hint",
        "convert",
        conv(profile=lambda c: c.file("p.json", "{}")),
        "p.json: a file, not a profile folder; pass the folder",
    ),
    Case(
        "deferred",
        "convert",
        conv(recipe='name = "r"\n[key]\nbits = 4\nrotation = "hadamard"\n', model=head_dim_10),
        "rotates heads of head_dim = 10",
    ),
    Case("deferred", "convert", conv(recipe="quarot-kv4", model=head_dim_10), "head_dim = 10"),
    Case(
        "deferred",
        "convert",
        conv(model=lambda c: config(c, rope_parameters={"rope_type": "dynamic", "factor": 2.0})),
        "the runtime could not serve the result (rope_type 'dynamic' in config.json",
    ),
    Case(
        "deferred",
        "convert",
        conv(model=lambda c: config(c, hidden_act="gelu")),
        "the runtime could not serve the result (hidden_act 'gelu' in config.json is not supported",
    ),
    Case(
        "deferred",
        "convert",
        conv(model=bad_tokenizer),
        "tokenizer.json: not a tokenizer the tokenizers library reads",
    ),
    Case("deferred", "convert", conv(model=vocab_100), "128 tokens, but config.json's vocab_size"),
]


@pytest.mark.parametrize(
    "case", CALIBRATE + CONVERT, ids=lambda c: f"{c.command}-{c.cls}-{c.fragment[:24]}"
)
def test_bad_input_is_refused_early_in_one_line(case, corpus, tmp_path, monkeypatch):
    check(case, Workspace(tmp_path, corpus), monkeypatch)


def test_an_export_for_vllm_also_loads_in_the_runtime(corpus, tmp_path):
    """--export vllm-fp8 adds k_scale / v_scale tensors beside the weights; the runtime skips
    them rather than refusing the folder (generate used to fail on what convert had written)."""
    import kvcalib
    import kvcalib_runtime

    out = kvcalib.convert(
        corpus.src, recipe="per-token-4", output=tmp_path / "fp8", profile=corpus.profile,
        export="vllm-fp8",
    )  # fmt: skip
    model = kvcalib_runtime.load(out, device="cpu")
    assert len(model.generate("hello", 2, eos_token_id=[])[0]) == 2


def test_every_dtype_option_offers_what_the_api_takes():
    """One --dtype block for every command that loads weights, its choices the API's dtypes."""
    from kvcalib.cli import main
    from kvcalib.core.options import DTYPES

    for command in ("calibrate", "convert", "eval"):
        [option] = [p for p in main.commands[command].params if p.name == "dtype"]
        assert tuple(option.type.choices) == tuple(DTYPES)
