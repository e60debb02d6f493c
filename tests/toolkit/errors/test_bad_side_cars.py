"""The bad-input corpus, part 3: converted checkpoints whose side-car means nothing sane, and
bad arguments, through `kvcalib_runtime.load` (a KvcalibRuntimeError subclass, one line) and
through the commands that read a side-car (generate, eval, inspect: exit 2, one line).

Every damaged file is listed in a rewritten manifest, as a careless or hostile writer would
leave it: the validator, not the sha256, must refuse it — before any weight loads.
"""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.corpus import Case, Workspace, check, nan_at, remanifest

import kvcalib_runtime

SP = "sink_predictor"


def params(edit):
    """The converted copy with kv_params.safetensors edited by edit(tensors)."""
    return lambda ctx: ctx.side_car(params=edit)


def scheme(edit):
    """The converted copy with kvcalib.json's scheme edited by edit(scheme)."""
    return lambda ctx: ctx.side_car(meta=lambda m: edit(m["scheme"]))


def layer(i: int, **changes):
    def edit(s):
        for key, value in changes.items():
            *path, last = key.split(".")
            target = s["layers"][i]
            for k in path:
                target = target[k]
            target[last] = value

    return scheme(edit)


def put(**tensors):
    """Add or replace kv_params tensors (names with "__" for ".")."""
    return params(lambda t: t.update({k.replace("__", "."): v for k, v in tensors.items()}))


def change(name: str, fn):
    return params(lambda t: t.update({name: fn(t[name])}))


def predictor(dims, threshold, layer_=0):
    return put(
        sink_predictor__dims=torch.tensor(dims, dtype=torch.int64),
        sink_predictor__threshold=torch.tensor([threshold], dtype=torch.float32),
        sink_predictor__layer=torch.tensor([layer_], dtype=torch.int64),
    )


def swap_range(t):
    lo, hi = t["layers.1.key_range_lo"], t["layers.1.key_range_hi"]
    t["layers.1.key_range_lo"], t["layers.1.key_range_hi"] = hi, lo


def unpair(s: torch.Tensor) -> torch.Tensor:
    s = s.clone()
    s[:, 0] *= 2
    return s


def fifo_instead(name: str):
    def build(ctx):
        path = ctx.converted
        (path / name).unlink()
        ctx.fifo(f"converted/{name}")
        return path

    return build


def load(build, **kwargs):
    """The runtime's load of the folder build(ctx) makes, on the CPU unless `device` says
    otherwise: the folder is made when the case is built, the load happens when it runs."""
    kwargs.setdefault("device", "cpu")

    def make(ctx):
        folder = build(ctx)
        return lambda: kvcalib_runtime.load(folder, **kwargs)

    return make


def generate(*args, **kwargs):
    """RuntimeModel.generate on the intact copy (the checkpoint loads first)."""

    def build(ctx):
        folder = ctx.converted
        return lambda: kvcalib_runtime.load(folder, device="cpu").generate(*args, **kwargs)

    return build


def new_cache(batch, max_len, full_precision=False):
    """RuntimeModel.new_cache on the intact copy (the checkpoint loads first)."""

    def build(ctx):
        model = kvcalib_runtime.load(ctx.converted, device="cpu")
        return lambda: model.new_cache(batch, max_len, full_precision=full_precision)

    return build


def manifest_entry(name: str, **changes):
    """The converted copy with the manifest's entry for `name` changed."""

    def build(ctx):
        path = ctx.converted
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["files"][name].update(changes)
        (path / "manifest.json").write_text(json.dumps(manifest))
        return path

    return build


def unbound(name: str, edit):
    """The converted copy with the file `name` (safetensors) edited by edit(tensors) and the
    manifest rewritten, the binding in kvcalib.json left as converted: another conversion's
    kv_params, or weights changed after the conversion."""

    def build(ctx):
        path = ctx.converted
        tensors = load_file(path / name)
        edit(tensors)
        save_file(tensors, path / name, metadata={"format": "pt"})
        remanifest(path)
        return path

    return build


def converted(ctx):
    return ctx.converted


NAN = float("nan")
LOAD = [
    Case("numbers", "load", load(change("layers.0.key_range_lo", nan_at)), "range lo holds 1 NaN"),
    Case("numbers", "load", load(params(swap_range)), "layer 1 key range has lo > hi"),
    Case(
        "numbers",
        "load",
        load(
            put(
                layers__0__key_range_lo=torch.full((2, 16), -2e38),
                layers__0__key_range_hi=torch.full((2, 16), 2e38),
            )
        ),
        "wider than float32 holds",
    ),
    Case(
        "numbers",
        "load",
        load(change("layers.0.key_codebook", lambda t: t.flip(0))),
        "codebook levels are not sorted",
    ),
    Case(
        "numbers",
        "load",
        load(change("layers.0.key_codebook", lambda t: t[:3].contiguous())),
        "2 bits need [4] or [2, 4] levels",
    ),
    Case(
        "numbers",
        "load",
        load(change("layers.0.key_codebook", lambda t: t * 3)),
        "outside the normalized domain [0, 1]",
    ),
    Case(
        "numbers",
        "load",
        load(change("layers.0.value_codebook", lambda t: t.expand(3, -1).contiguous())),
        "codebook has shape [3, 4]",
    ),
    Case(
        "numbers",
        "load",
        load(change("layers.0.value_codebook", lambda t: t - 2)),
        "outside the normalized domain [-1, 1]",
    ),
    Case(
        "numbers",
        "load",
        load(change("layers.0.key_codebook", lambda t: nan_at(t, math.inf))),
        "key codebook holds 1 NaN or Inf",
    ),
    Case("numbers", "load", load(change("layers.0.key_smooth", lambda s: -s)), "scale(s) <= 0"),
    Case("numbers", "load", load(change("layers.1.key_smooth", unpair)), "RoPE pair members"),
    Case(
        "numbers",
        "load",
        load(change("layers.1.key_smooth", lambda s: nan_at(s, math.inf))),
        "key_smooth holds 1 NaN or Inf",
    ),
    Case(
        "numbers",
        "load",
        load(
            put(
                layers__0__value_range_lo=torch.zeros(2, 16),
                layers__0__value_range_hi=torch.ones(2, 16),
            )
        ),
        "the scheme is not 'static', but a calibrated range is given",
    ),
    Case(
        "numbers",
        "load",
        load(params(lambda t: t.pop("layers.1.key_codebook"))),
        "layer 1 key: the scheme uses a codebook, but none is given",
    ),
    Case(
        "numbers",
        "load",
        load(change("layers.0.key_range_lo", lambda t: t.long())),
        "has dtype I64",
    ),
    Case("numbers", "load", load(predictor([1], NAN)), "threshold = nan: use a finite number"),
    Case("numbers", "load", load(predictor([3, 3], 1.0)), "use distinct dims in [0, 64)"),
    Case("numbers", "load", load(predictor([3], -1.0)), "threshold = -1.0"),
    Case(
        "size",
        "load",
        load(scheme(lambda s: s.update(sink_budget=10**12))),
        "sinks_first + sink_budget = 1000000000001 asks for sink slots that would take",
    ),
    Case(
        "size",
        "load",
        load(scheme(lambda s: s.update(residual=2**63))),
        "residual = 9223372036854775808 asks for the residual window",
    ),
    Case(
        "size",
        "load",
        load(layer(0, key_flush=300)),
        "layer 0 key: flush = 300 exceeds the residual window 16",
    ),
    Case(
        "numbers",
        "load",
        load(scheme(lambda s: s.update(residual=16.0))),
        "residual = 16.0 must be int",
    ),
    Case("numbers", "load", load(layer(0, **{"key.bits": True})), "bits = True must be an"),
    Case(
        "numbers",
        "load",
        load(layer(1, **{"value.codebook": "yes"})),
        "codebook = 'yes' must be true or false",
    ),
    Case("numbers", "load", load(layer(0, value_flush=0)), "value flush = 0 must be >= 1"),
    Case(
        "numbers",
        "load",
        load(layer(0, **{"key.group": 32})),
        "unknown key scheme.layers[0].key.group (known: bits, ",
    ),
    Case("numbers", "load", load(scheme(lambda s: s.update(sinks=4))), "unknown key scheme.sinks"),
    Case(
        "numbers",
        "load",
        load(lambda c: c.side_car(meta=lambda m: m["source"].update(url="x"))),
        "kvcalib.json: source: unknown key source.url",
    ),
    Case(
        "numbers",
        "load",
        load(layer(0, key_rotation="true")),
        "key_rotation = 'true' must be bool",
    ),
    Case(
        "numbers",
        "load",
        load(lambda c: c.side_car(config=lambda cfg: cfg.update(num_hidden_layers=3))),
        "scheme has 2 layers, config.json 3",
    ),
    Case(
        "numbers",
        "load",
        load(lambda c: c.side_car(config=lambda cfg: cfg.update(vocab_size=100))),
        "128 tokens, but config.json's vocab_size is 100",
    ),
    Case(
        "special",
        "load",
        load(lambda c: c.side_car(files={"tokenizer.json": b"{not json"})),
        "not a tokenizer the tokenizers library reads",
    ),
    Case("special", "load", load(fifo_instead("manifest.json")), "not a regular file"),
    Case(
        "numbers",
        "load",
        load(unbound("kv_params.safetensors", lambda t: t["layers.0.key_range_lo"].mul_(2))),
        "kv_params.safetensors: not the file kvcalib.json was converted with",
    ),
    Case(
        "numbers",
        "load",
        load(unbound("model-00001-of-00001.safetensors", lambda t: t["model.norm.weight"].mul_(2))),
        "model*.safetensors: not the weights kvcalib.json and kv_params.safetensors were",
    ),
    Case(
        "numbers",
        "load",
        load(manifest_entry("config.json", size="12")),
        "manifest.json: entry 'config.json' has size '12', not a byte count",
    ),
    Case(
        "numbers",
        "load",
        load(manifest_entry("config.json", sha256=7)),
        "manifest.json: entry 'config.json' has sha256 '7', not 64 hex digits",
    ),
    Case("special", "load", load(fifo_instead("kv_params.safetensors")), "not a regular file"),
    Case("size", "load", load(converted, max_len=10**12), "max_len = 1000000000000: use a"),
    Case("options", "load", load(converted, max_len=True), "max_len = True"),
    Case("options", "load", load(converted, device="tpu"), "'tpu' is not one the runtime"),
    Case("options", "load", load(converted, device="cuda:7"), "cuda:7"),
    Case("options", "load", load(converted, dtype="float16"), "use a floating torch dtype"),
    Case("options", "load", generate("hi", 2, temperature=NAN), "temperature = nan", False),
    Case("options", "load", generate("hi", 2, temperature=1.0, top_p=0.0), "top_p = 0.0", False),
    Case("options", "load", generate("hi", 0), "max_new_tokens = 0: ask for at least 1", False),
    Case("options", "load", generate("hi", 2.5), "max_new_tokens = 2.5: use an integer", False),
    Case("numbers", "load", generate([5, 999], 2), "token ids in [0, 128)", False),
    Case(
        "size", "load", generate("hi", 10**9), "the model's context of 256 tokens: shorten", False
    ),
    Case("options", "load", generate([], 4), "no prompts: pass a str", False),
    Case("options", "load", new_cache(0, 16), "batch = 0: use an integer >= 1", False),
    Case("options", "load", new_cache(-1, 16), "batch = -1: use an integer >= 1", False),
    Case("options", "load", new_cache(1, 0), "max_len = 0: use an integer >= 1", False),
    Case("options", "load", new_cache(0, 16, True), "batch = 0: use an integer >= 1", False),
]

NAN_RANGE = params(
    lambda t: t.update({"layers.0.key_range_lo": nan_at(t["layers.0.key_range_lo"])})
)
COMMANDS = [
    Case("numbers", "generate", lambda c: [NAN_RANGE(c), "--prompt", "hi"], "holds 1 NaN"),
    Case(
        "numbers",
        "eval",
        lambda c: [NAN_RANGE(c), "--seq-len", "16", "--windows", "1", "--data", c.file("t.txt")],
        "range lo holds 1 NaN",
    ),
    Case("numbers", "inspect", lambda c: [NAN_RANGE(c)], "range lo holds 1 NaN"),
    Case(
        "size",
        "inspect",
        lambda c: [scheme(lambda s: s.update(sinks_first=10**6))(c)],
        "sinks_first + sink_budget = 1000000 asks for sink slots",
    ),
]


@pytest.mark.parametrize(
    "case", LOAD + COMMANDS, ids=lambda c: f"{c.command}-{c.cls}-{c.fragment[:24]}"
)
def test_bad_side_car_or_argument_is_refused_in_one_line(case, corpus, tmp_path, monkeypatch):
    check(case, Workspace(tmp_path, corpus), monkeypatch)


def test_a_hub_clone_of_a_conversion_loads_and_inspects(corpus, tmp_path):
    """What a clone of an uploaded conversion adds (.git/, README.md) is not part of the
    checkpoint: the runtime loads it and the commands read it (both refused "extra file")."""
    from click.testing import CliRunner

    from kvcalib.cli import main

    ctx = Workspace(tmp_path, corpus)
    folder = ctx.converted
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (folder / "README.md").write_text("# tiny, converted\n")
    model = kvcalib_runtime.load(folder, device="cpu")
    assert len(model.generate("hi", 2, eos_token_id=[])[0]) == 2
    result = CliRunner().invoke(main, ["inspect", str(folder)])
    assert result.exit_code == 0, result.output


def test_the_readme_snippet_loads_where_it_runs(corpus, monkeypatch):
    """The README's Python snippet asked for device="cuda" and died on a CPU machine after the
    calibration: it names no device, and the runtime's default is the CPU without CUDA."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    snippet = readme.split("```python\n")[1].split("```")[0]
    assert re.search(r'kvcalib_runtime\.load\("converted/"\)', snippet)
    assert "cuda" not in snippet.replace("# device: cuda when there is one, else cpu", "")
    assert snippet.count("progress=True") == 2  # calibrate and evaluate show their bars
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kvcalib_runtime.load(corpus.converted).device.type == "cpu"


def test_a_version_2_side_car_without_a_binding_still_loads(corpus, tmp_path):
    """Version 3 binds kv_params.safetensors to the weights; folders converted before it, at
    version 2, hold no binding and load as they did."""
    folder = Workspace(tmp_path, corpus).side_car(
        meta=lambda m: (m.pop("binding"), m.update(format_version=2))
    )
    model = kvcalib_runtime.load(folder, device="cpu")
    assert model.meta["format_version"] == 2 and "binding" not in model.meta
