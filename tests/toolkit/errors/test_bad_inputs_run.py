"""The bad-input corpus, part 2: `kvcalib eval`, `kvcalib generate` and `kvcalib inspect`.

Same contract as part 1 (test_bad_inputs.py, `corpus.check`): exit 2, one line naming the input
and a fix, nothing written, no input changed, answered before any model loads unless the row
says the answer needs the model (NaN logits need a forward pass; a request longer than the
cache needs the checkpoint's context).
"""

import pytest
from support.corpus import (
    STATIC,
    Case,
    Workspace,
    check,
    config,
    config_bytes,
    deep,
    meta,
    profile_file,
    quantiles,
    the_profile,
)
from support.tiny import save_with_tokenizer, tiny_model


def ev(*args, recipe="per-token-4", model=None, data=True):
    """eval (the model copy, or `model(ctx)`) on one window of 16 tokens with `recipe` (a
    preset, or text for a recipe file); a callable argument gets the workspace."""

    def build(ctx):
        base = [model(ctx) if model else ctx.src, "--seq-len", "16", "--windows", "1"]
        base += ["--data", ctx.file("t.txt")] if data else []
        if recipe is not None:
            base += ["--recipe", ctx.recipe(recipe) if "\n" in recipe else recipe]
        return base + [a(ctx) if callable(a) else a for a in args]

    return build


def gen(*args, folder=None):
    """generate from the converted copy (or `folder(ctx)`) with `args`."""

    def build(ctx):
        base = [folder(ctx) if folder else ctx.converted, "--prompt", "hi", "--device", "cpu"]
        return base + [a(ctx) if callable(a) else a for a in args]

    return build


def nan_model(ctx: Workspace):
    """A model whose LM head holds one NaN: every logit of token 0 is NaN."""
    net = tiny_model("llama", max_position_embeddings=256)
    net.lm_head.weight.data[0, 0] = float("nan")
    return save_with_tokenizer(net, ctx.root / "nan-model")


def huge_ranges(ctx: Workspace):
    """Key ranges of +-1e5: finite and ordered, so the profile is read, but beyond float16,
    where a float16 cache's scales overflow."""

    def change(t):
        for scope in ("all", "nonsink"):
            q = t[f"key_pre_rope.{scope}.quantiles"]
            half = q.shape[-1] // 2
            q[..., :half], q[..., half:] = -1e5, 1e5

    return ctx.profile_tensors(change, rebind=True)


def drop_sinks(ctx: Workspace):
    return ctx.profile_json(lambda m: m.pop("sinks"))


EVAL = [
    Case("options", "eval", ev("--seq-len", "-1"), "--seq-len -1: use an integer"),
    Case("options", "eval", ev("--seq-len", "1"), "--seq-len 1: use an integer >= 2"),
    Case("options", "eval", ev("--windows", "0"), "--windows 0: use an integer"),
    Case("options", "eval", ev("--windows", "-2"), "--windows -2"),
    Case("options", "eval", ev("--device", "tpu"), "--device tpu: not a device"),
    Case("options", "eval", ev("--device", "cuda:7"), "--device cuda:7"),
    Case("options", "eval", ev("--dtype", "x"), "'--dtype'"),
    Case("options", "eval", ev("--mode", "x"), "'--mode'"),
    Case("options", "eval", ev(recipe="kivi3"), "recipe kivi3: no such preset; did"),
    Case("size", "eval", ev("--seq-len", "1000"), "--seq-len 1000 exceeds the model's context"),
    Case("hint", "eval", ev(model=the_profile), "this is a profile folder"),
    Case("output", "eval", ev("--json", lambda c: c.folder("j")), "a folder or special file"),
    Case("output", "eval", ev("--json", lambda c: c.src / "r.json"), "overlaps the input"),
    Case("output", "eval", ev("--json", lambda c: c.root / "t.txt"), "overlaps the input"),
    Case("output", "eval", ev("--json", lambda c: c.root / "no" / "r.json"), "does not exist"),
    Case("output", "eval", ev("--plots", lambda c: c.file("p")), "--plots"),
    Case("output", "eval", ev("--plots", lambda c: c.src / "plots"), "overlaps the input"),
    Case(
        "numbers",
        "eval",
        ev("--profile", quantiles(float("nan")), recipe=STATIC),
        "holds 1 NaN or Inf value(s)",
    ),
    Case(
        "numbers",
        "eval",
        ev("--profile", meta(**{"model.fingerprint": "f" * 64}), recipe=STATIC),
        "was calibrated on model",
    ),
    Case(
        "numbers",
        "eval",
        ev(recipe='name = "r"\n[key]\nbits = 2\n[[layers]]\nindex = 9\nkey = {bits = 4}\n'),
        "[[layers]] index 9 names a layer the model does not have",
    ),
    Case(
        "size",
        "eval",
        ev(recipe='name = "r"\nresidual = 5000\n[key]\nbits = 4\n'),
        "residual = 5000 asks for the residual window",
    ),
    Case("options", "eval", ev(recipe=None), "name at least one --recipe"),
    Case(
        "size",
        "eval",
        ev("--passkey"),
        "--passkey runs passkeys at 1024,2048,4096 tokens, beyond the model's context (256",
    ),
    Case(
        "size",
        "eval",
        ev("--long-context"),
        "--long-context runs the suite at 2048,4096,8192 tokens, beyond the model's context",
    ),
    Case(
        "size",
        "eval",
        ev("--long-context-lengths", "128,512"),
        "--long-context-lengths 512 exceeds the model's context (256 tokens): use lengths up",
    ),
    Case(
        "options",
        "eval",
        ev("--long-context-lengths", "0"),
        "--long-context-lengths 0: use positive token counts",
    ),
    Case("options", "eval", ev("--mode", "fake", "--residual", "8"), "does not apply to --mode"),
    Case(
        "special",
        "eval",
        ev("--data", lambda c: c.file("l1.txt", "caf\xe9 ".encode("latin-1") * 99), data=0),
        "not UTF-8 text (byte 3); save the file as UTF-8",
    ),
    Case("special", "eval", ev("--data", lambda c: c.fifo(), data=False), "not a regular file"),
    Case(
        "special",
        "eval",
        ev("--data", lambda c: c.file("d.jsonl", deep()), data=False),
        "nests JSON too deeply",
    ),
    Case("special", "eval", ev(model=lambda c: c.fifo("m")), "a FIFO, socket or device"),
    Case(
        "numbers",
        "eval",
        ev(model=nan_model),
        "full precision, window 0: NaN or Inf in the logits",
        before_load=False,
    ),
    Case(
        "numbers",
        "eval",
        ev("--profile", huge_ranges, "--dtype", "float16", recipe=STATIC),
        "recipe st, window 0: NaN or Inf in the logits",
        before_load=False,
    ),
]

GENERATE = [
    Case("hint", "generate", gen(folder=the_profile), "this is a profile folder"),
    Case("hint", "generate", gen(folder=lambda c: c.src), "a model folder, not a converted"),
    Case("options", "generate", gen("--max-new-tokens", "0"), "--max-new-tokens 0"),
    Case("options", "generate", gen("--max-new-tokens", "-1"), "--max-new-tokens -1"),
    Case("options", "generate", gen("--temperature", "nan"), "--temperature nan: use a finite"),
    Case("options", "generate", gen("--temperature", "inf"), "--temperature inf: use a finite"),
    Case("options", "generate", gen("--temperature", "-1"), "--temperature -1.0: use a"),
    Case("options", "generate", gen("--top-p", "0"), "--top-p 0.0: use a finite number in (0"),
    Case("options", "generate", gen("--top-p", "1.5"), "--top-p 1.5"),
    Case("options", "generate", gen("--top-p", "nan"), "--top-p nan"),
    Case("options", "generate", gen("--device", "tpu"), "--device tpu: not a device"),
    Case("options", "generate", gen("--device", "cuda:7"), "--device cuda:7"),
    Case(
        "options",
        "generate",
        lambda c: [c.converted, "--prompt", "", "--device", "cpu"],
        "--prompt '': give some text",
    ),
    Case("special", "generate", gen(folder=lambda c: c.fifo("ckpt")), "a FIFO, socket or device"),
    Case("special", "generate", gen("--document", lambda c: c.fifo("doc")), "--document"),
    Case("options", "generate", gen("--document", "pydoc:nope"), "no such topic"),
    Case(
        "size",
        "generate",
        gen("--max-new-tokens", "1000000000"),
        "more than the model's context of 256 tokens: shorten",
        before_load=False,
    ),
]

INSPECT = [
    Case("numbers", "inspect", lambda c: [quantiles(float("inf"))(c)], "NaN or Inf value(s)"),
    Case("numbers", "inspect", lambda c: [meta(num_samples=0)(c)], "num_samples = 0 is not a"),
    Case("special", "inspect", lambda c: [c.fifo("x")], "a FIFO, socket or device"),
    Case(
        "numbers",
        "inspect",
        lambda c: [config(c, num_hidden_layers=3)],
        "config.json has 3 layers, but the weights hold no",
    ),
    Case("special", "inspect", lambda c: [profile_file("profile.json", deep())(c)], "not valid"),
    Case("numbers", "inspect", lambda c: [drop_sinks(c)], "lacks or garbles a field"),
    Case(
        "special",
        "inspect",
        lambda c: [config_bytes(c, b'{"model_type": "\xff"}')],
        "config.json is not valid JSON",
    ),
    Case("special", "inspect", lambda c: [c.file("notes.txt")], "a file that is not .gguf"),
    Case("options", "inspect", lambda c: [c.root / "missing"], "no such file or folder"),
]


@pytest.mark.parametrize(
    "case", EVAL + GENERATE + INSPECT, ids=lambda c: f"{c.command}-{c.cls}-{c.fragment[:24]}"
)
def test_bad_input_is_refused_early_in_one_line(case, corpus, tmp_path, monkeypatch):
    check(case, Workspace(tmp_path, corpus), monkeypatch)
