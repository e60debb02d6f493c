"""`kvcalib generate`: complete a prompt with a converted checkpoint through the runtime's
quantized KV cache, streaming the text as it comes, then report decode speed and cache size.

    report = generate_text("converted/", "Once upon a time", max_new_tokens=64, on_text=print)
    print(format_report(report))

The model runs in `kvcalib_runtime` (what a serving box installs); kvcalib adds only the chat
template, which transformers renders (`--chat`).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

import kvcalib_runtime
from kvcalib.core import preflight
from kvcalib.errors import ModelError

KIB = 1024
LONG_CONTEXT = 4096  # the context the memory claim is made at


@dataclass(frozen=True)
class GenerationReport:
    """One generate call, measured.

    text:                  the new text (special tokens skipped)
    prompt_tokens:         tokens of the prompt, chat template included
    new_tokens:            tokens generated (the first comes from the prefill)
    prefill_seconds:       from the call until the first new token
    decode_tokens_per_s:   the other new tokens per second of decoding; None with one token
    kv_bytes_per_token:    the quantized cache's storage per token at the final context
                           (prompt + new tokens), sinks and residual window amortized
    fp16_bytes_per_token:  an fp16 cache's, for the same model
    long_bytes_per_token:  the quantized cache's storage per token at LONG_CONTEXT tokens, where
                           the exact residual window no longer dominates
    """

    text: str
    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float
    decode_tokens_per_s: float | None
    kv_bytes_per_token: float
    fp16_bytes_per_token: int
    long_bytes_per_token: float

    @property
    def context(self) -> int:
        return self.prompt_tokens + self.new_tokens


def generate_text(
    path: str | Path,
    prompt: str,
    *,
    max_new_tokens: int = 128,
    device: str | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    chat: bool = False,
    on_text: Callable[[str], None] | None = None,
) -> GenerationReport:
    """Generate up to `max_new_tokens` after `prompt` with the converted checkpoint at `path`.

    device:  default "cuda" when available, else "cpu"
    temperature, top_p: 0 is greedy; else sampling from the top_p nucleus
    chat:    wrap the prompt as one user message in the folder's chat template
    on_text: called with each new piece of text as soon as it decodes to whole characters
    Every option and the folder's kind are checked before the checkpoint loads.
    """
    preflight.generate(
        path,
        prompt,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        device=device,
    )
    model = kvcalib_runtime.load(path, device=device)
    if chat:
        ids = model.tokenizer.encode(chat_prompt(path, prompt), add_special_tokens=False).ids
    else:
        ids = model.encode(prompt)
    stream = TextStream(model.decode, on_text) if on_text is not None else None
    stamps: list[float] = []

    def step(_, tokens):  # one sequence: tokens[0] is this step's token
        stamps.append(time.perf_counter())
        if stream is not None:
            stream.push(tokens[0])

    start = time.perf_counter()
    [new] = model.generate(
        [ids], max_new_tokens, temperature=temperature, top_p=top_p, callback=step
    )
    if stream is not None:
        stream.close()
    return GenerationReport(
        text=model.decode(new),
        prompt_tokens=len(ids),
        new_tokens=len(new),
        prefill_seconds=stamps[0] - start,
        decode_tokens_per_s=(len(new) - 1) / (stamps[-1] - stamps[0]) if len(new) > 1 else None,
        kv_bytes_per_token=model.kv_bytes_per_token(len(ids) + len(new)),
        fp16_bytes_per_token=model.fp16_bytes_per_token(),
        long_bytes_per_token=model.kv_bytes_per_token(LONG_CONTEXT),
    )


class TextStream:
    """Incremental detokenization: `push` token ids one at a time and `on_text` gets the new
    text as soon as it decodes to whole characters (an incomplete UTF-8 character decodes to
    U+FFFD and waits for its other bytes); `close` flushes whatever is left."""

    def __init__(self, decode: Callable[[list[int]], str], on_text: Callable[[str], None]):
        self.decode, self.on_text = decode, on_text
        self.ids: list[int] = []
        self.shown = ""

    def push(self, token: int) -> None:
        self.ids.append(token)
        text = self.decode(self.ids)
        if not text.endswith("\ufffd"):
            self._emit(text)

    def close(self) -> None:
        self._emit(self.decode(self.ids))

    def _emit(self, text: str) -> None:
        if len(text) > len(self.shown):
            self.on_text(text[len(self.shown) :])
        self.shown = text


def chat_prompt(path: str | Path, prompt: str) -> str:
    """`prompt` as one user message of the folder's chat template, ready for the reply."""

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    if not tokenizer.chat_template:
        raise ModelError(
            f"{path}: --chat needs a chat template (chat_template.jinja, or chat_template in "
            "tokenizer_config.json) and the folder has none; drop --chat"
        )
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def format_report(report: GenerationReport) -> str:
    """Two lines: prefill and decode speed, then the KV cache's size against fp16, at this
    context and at LONG_CONTEXT tokens."""
    speed = (
        f"{report.decode_tokens_per_s:.1f} tokens/s"
        if report.decode_tokens_per_s is not None
        else "n/a tokens/s (one token)"
    )
    return (
        f"prefill: {report.prompt_tokens} tokens in {report.prefill_seconds:.2f} s; "
        f"decode: {max(report.new_tokens - 1, 0)} tokens at {speed}\n"
        f"KV cache: {report.kv_bytes_per_token / KIB:.2f} KiB/token at {report.context} tokens "
        f"vs {report.fp16_bytes_per_token / KIB:.2f} KiB/token fp16 "
        f"(ratio {report.kv_bytes_per_token / report.fp16_bytes_per_token:.3f}); "
        f"at {LONG_CONTEXT} tokens {report.long_bytes_per_token / KIB:.2f} KiB/token "
        f"(ratio {report.long_bytes_per_token / report.fp16_bytes_per_token:.3f})"
    )
