"""`kvcalib generate`: streams the completion, then reports decode speed and the cache size.

The text printed must be exactly what the runtime generates (greedy, so deterministic), and
the report lines must carry numbers; a folder that is not a converted checkpoint exits 2 with
one line naming it.
"""

import re

import pytest
from click.testing import CliRunner
from tiny import save_with_tokenizer, tiny_model

import kvcalib_runtime
from kvcalib import convert
from kvcalib.cli import main
from kvcalib.generate import TextStream, generate_text

SPEED = re.compile(r"^prefill: 5 tokens in [\d.]+ s; decode: (\d+) tokens at [\d.]+ tokens/s$")
SIZE = re.compile(
    r"^KV cache: ([\d.]+) KiB/token at (\d+) tokens vs ([\d.]+) KiB/token fp16 \(ratio [\d.]+\); "
    r"at 4096 tokens ([\d.]+) KiB/token \(ratio [\d.]+\)$"
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
    text, speed, size = result.output.rsplit("\n", 3)[:3]
    assert text == expected.decode(new)
    assert int(SPEED.match(speed).group(1)) == len(new) - 1
    kib, context, fp16, long = SIZE.match(size).groups()
    assert int(context) == 5 + len(new)
    assert float(kib) == pytest.approx(expected.kv_bytes_per_token(5 + len(new)) / 1024, abs=0.01)
    assert float(long) == pytest.approx(expected.kv_bytes_per_token(4096) / 1024, abs=0.01)
    assert float(fp16) == expected.fp16_bytes_per_token() / 1024


def test_streamed_pieces_are_the_text_token_by_token(folder):
    pieces = []
    report = generate_text(folder, "Hi", max_new_tokens=5, device="cpu", on_text=pieces.append)
    assert "".join(pieces) == report.text
    assert len(pieces) == report.new_tokens  # one character per token, printed as it came


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
