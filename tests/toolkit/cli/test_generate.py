"""`kvcalib generate`: streams the completion, then reports decode speed and the cache size.

The text printed must be exactly what the runtime generates (greedy, so deterministic), and
the report lines must carry numbers; a folder that is not a converted checkpoint exits 2 with
one line naming it.
"""

import re

import pytest
from click.testing import CliRunner
from support.tiny import save_with_tokenizer, tiny_model

import kvcalib_runtime
from kvcalib import convert
from kvcalib.cli import main
from kvcalib.generate import TextStream, generate_text
from kvcalib_runtime.kernels import native

SPEED = re.compile(r"^prefill: 5 tokens in [\d.]+ s; decode: (\d+) tokens at [\d.]+ tokens/s$")
MEMORY = re.compile(
    r"^KV cache allocated for (\d+) tokens \(float32\): ([\d.]+) MiB quantized"
    r"(?: vs ([\d.]+) MiB full precision \(ratio ([\d.]+)\))?$"
)
LONG = re.compile(
    r"^at 4096 tokens \(fp16\): ([\d.]+) KiB/token vs ([\d.]+) KiB/token fp16 \(ratio [\d.]+\)$"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny llama converted with quarot-kv4; ASCII tokenizer, one token per character."""
    root = tmp_path_factory.mktemp("generate")
    source = root / "source"
    save_with_tokenizer(tiny_model("llama"), source)
    (source / "chat_template.jinja").write_text(CHATML)
    return convert(source, recipe="quarot-kv4", output=root / "converted")


def test_generate_prints_the_text_then_speed_and_cache_size(folder):
    expected = kvcalib_runtime.load(folder, device="cpu")
    [new] = expected.generate("Hello", 6)
    result = CliRunner().invoke(
        main, ["generate", str(folder), "--prompt", "Hello", "--max-new-tokens", "6",
               "--device", "cpu"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    text, speed, memory, long = result.output.rsplit("\n", 4)[:4]
    assert text == expected.decode(new)
    assert int(SPEED.match(speed).group(1)) == len(new) - 1
    context, mib, full, _ = MEMORY.match(memory).groups()
    assert int(context) == 5 + 6 - 1 and full is None
    walked = expected.new_cache(1, 10).allocated_bytes()
    assert float(mib) == pytest.approx(walked / 2**20, abs=0.01)
    kib, fp16 = LONG.match(long).groups()
    assert float(kib) == pytest.approx(expected.kv_bytes_per_token(4096) / 1024, abs=0.01)
    assert float(fp16) == expected.fp16_bytes_per_token(4096) / 1024


def test_a_cpu_load_builds_the_c_kernels_and_generate_says_so_first(folder, monkeypatch):
    """A machine's first use compiles the runtime's C kernels (15-17 s of CPU): the load does
    it, so that no decode step the report times pays for it, and `generate` says so first."""
    monkeypatch.setattr(native, "_LOADED", {})
    monkeypatch.delenv("TRITON_INTERPRET")  # the tests' default: Triton's interpreter on the CPU
    kvcalib_runtime.load(folder, device="cpu")
    assert "lib" in native._LOADED  # built, or found in the cache, by the load
    monkeypatch.setattr(native, "pending", lambda: True)
    notes = []
    generate_text(folder, "Hello", max_new_tokens=2, device="cpu", on_note=notes.append)
    assert notes == ["building the runtime's CPU kernels, once per machine (about 15 s)"]


def test_compare_fp16_answers_twice_and_measures_both_caches(folder, tmp_path):
    """The document goes before the question; both answers are printed under their cache's
    name, each what the runtime generates through that cache, and both caches' memory is what
    their buffers hold."""
    document = tmp_path / "doc.txt"
    document.write_text("abc " * 20)
    expected = kvcalib_runtime.load(folder, device="cpu")
    ids = expected.encode(document.read_text().strip() + "\n\nQ?")
    need = len(ids) + 4 - 1
    answers = {}
    for full in (False, True):
        cache = expected.new_cache(1, need, full_precision=full)
        [answers[full]] = expected.generate([ids], 4, cache=cache)
        answers[full, "bytes"] = cache.allocated_bytes()
    result = CliRunner().invoke(
        main, ["generate", str(folder), "--prompt", "Q?", "--document", str(document),
               "--max-new-tokens", "4", "--device", "cpu", "--compare-fp16"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    head, full_text = result.output.split("--- full-precision cache ---\n")
    assert head == f"--- quarot-kv4 cache ---\n{expected.decode(answers[False])}\n"  # own line
    assert full_text.startswith(expected.decode(answers[True]) + "\n")
    memory = next(line for line in result.output.splitlines() if MEMORY.match(line))
    context, mib, full_mib, ratio = MEMORY.match(memory).groups()
    assert int(context) == need
    assert float(mib) == pytest.approx(answers[False, "bytes"] / 2**20, abs=0.01)
    assert float(full_mib) == pytest.approx(answers[True, "bytes"] / 2**20, abs=0.01)
    assert float(ratio) < 1  # the 4-bit cache is smaller
    speed = next(line for line in result.output.splitlines() if line.startswith("prefill:"))
    # both caches' speed on the one line, the full-precision one named with its dtype
    assert re.fullmatch(
        r"prefill: \d+ tokens in [\d.]+ s; decode: 3 tokens at [\d.]+ tokens/s \(the "
        r"full-precision cache, float32: prefill [\d.]+ s, decode [\d.]+ tokens/s\)",
        speed,
    ), speed


def test_streamed_pieces_are_the_text_token_by_token(folder):
    pieces = []
    report = generate_text(folder, "Hi", max_new_tokens=5, device="cpu", on_text=pieces.append)
    assert "".join(pieces) == report.text
    assert len(pieces) == report.quantized.new_tokens  # one character per token, as it came


def test_a_partial_utf8_character_waits_for_its_other_bytes():
    pieces = []
    stream = TextStream(lambda ids: bytes(ids).decode("utf-8", errors="replace"), pieces.append)
    for byte in "aé".encode() + b"\xe2\x82":  # "a", "é" in two bytes, then half of "€"
        stream.push(byte)
    assert pieces == ["a", "é"]
    stream.close()
    assert pieces == ["a", "é", "\ufffd"]  # what is left shows at the end


def test_chat_wraps_the_prompt_in_the_template(folder):
    chat = generate_text(folder, "Hi", max_new_tokens=2, device="cpu", chat=True)
    wrapped = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert chat.prompt_tokens == len(wrapped)  # one token per character


def test_chat_without_a_template_exits_2(tmp_path):
    bare = tmp_path / "bare"
    source = tmp_path / "source"
    save_with_tokenizer(tiny_model("llama"), source)
    convert(source, recipe="fp16", output=bare)
    result = CliRunner().invoke(main, ["generate", str(bare), "--prompt", "a", "--chat"])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1
    assert "needs a chat template" in result.output and "drop --chat" in result.output


def test_a_folder_that_is_not_a_converted_checkpoint_exits_2(tmp_path):
    result = CliRunner().invoke(main, ["generate", str(tmp_path), "--prompt", "Hi"])
    assert result.exit_code == 2
    assert result.output.startswith("error: manifest.json: missing from ")
    assert result.output.count("\n") == 1
