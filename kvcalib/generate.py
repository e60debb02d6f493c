"""`kvcalib generate`: complete a prompt with a converted checkpoint through the runtime's
quantized KV cache, streaming the text as it comes, then report decode speed and the memory the
cache allocated; optionally the same prompt through a full-precision cache beside it.

    report = generate_text("converted/", "Once upon a time", max_new_tokens=64, on_text=print)
    print(format_report(report))

The model runs in `kvcalib_runtime` (what a serving box installs); kvcalib adds only the chat
template, which transformers renders (`--chat`), and the document a question is asked about
(`--document`: a text file, or `pydoc:TOPIC`, a topic of Python's built-in documentation).
Memory is what the caches' buffers hold (walked), never a formula.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from pydoc_data.topics import topics

from jinja2 import TemplateError  # transformers renders chat templates with it (torch needs it)
from transformers import AutoTokenizer

import kvcalib_runtime
from kvcalib.core import preflight
from kvcalib.errors import DataError, ModelError
from kvcalib_runtime.loader import builds_cpu_kernels

MIB = 1 << 20
LONG_CONTEXT = 4096  # where the memory claim is also made


@dataclass(frozen=True)
class Run:
    """One completion through one cache.

    text:             the new text (special tokens skipped)
    new_tokens:       tokens generated (the first comes from the prefill)
    prefill_seconds:  from the call until the first new token
    decode_tokens_per_s: the other new tokens per second of decoding; None with one token
    cache_bytes:      what the cache's buffers held (allocated for prompt + new tokens)
    """

    text: str
    new_tokens: int
    prefill_seconds: float
    decode_tokens_per_s: float | None
    cache_bytes: int


@dataclass(frozen=True)
class GenerationReport:
    """A generate call: the quantized run, the full-precision one when compared (each through
    a cache sized for `context` = prompt + new tokens - 1, the last token never being fed back),
    and the cache memory of this checkpoint's scheme at LONG_CONTEXT (walked on a meta-device
    cache) against an fp16 cache's, per token."""

    prompt_tokens: int
    context: int
    quantized: Run
    full_precision: Run | None
    dtype: str
    long_bytes_per_token: float
    long_fp16_bytes_per_token: float

    @property
    def text(self) -> str:
        return self.quantized.text


def document_text(spec: str) -> str:
    """The text of `--document`: a file's, or `pydoc:TOPIC`'s."""
    if spec.startswith("pydoc:"):
        topic = spec.removeprefix("pydoc:")
        if topic not in topics:
            raise DataError(
                f"--document {spec}: no such topic in Python's documentation; use one, e.g. "
                "pydoc:sequence-types, pydoc:try (pydoc_data.topics lists them all)"
            )
        return topics[topic].strip()
    path = Path(spec)
    if path.exists() and not path.is_file():  # a folder, or a FIFO a read would block on
        raise DataError(f"--document {spec}: not a regular file; pass a text file or pydoc:TOPIC")
    if not path.is_file():
        raise DataError(f"--document {spec}: no such file; pass a text file or pydoc:TOPIC")
    return path.read_text(encoding="utf-8", errors="replace").strip()


def generate_text(
    path: str | Path,
    prompt: str,
    *,
    max_new_tokens: int = 128,
    device: str | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    chat: bool = False,
    document: str | None = None,
    compare: bool = False,
    on_text: Callable[[str], None] | None = None,
    on_section: Callable[[str], None] | None = None,
    on_note: Callable[[str], None] | None = None,
) -> GenerationReport:
    """Generate up to `max_new_tokens` after `prompt` with the converted checkpoint at `path`.

    device:     default "cuda" when available, else "cpu"
    temperature, top_p: 0 is greedy; else sampling from the top_p nucleus
    chat:       wrap the prompt as one user message in the folder's chat template
    document:   put this document (`document_text`) before the prompt
    compare:    also generate through a full-precision cache of the same model
    on_text:    called with each new piece of text as soon as it decodes to whole characters
    on_section: called with a title before each run's text, when comparing
    on_note:    called with a line on one-time work before it starts (building the CPU kernels)
    Every option, the document and the folder's kind are checked before the checkpoint loads.
    """
    preflight.generate(
        path,
        prompt,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        device=device,
    )
    if document is not None:
        prompt = f"{document_text(document)}\n\n{prompt}"
    if on_note is not None and builds_cpu_kernels(device):
        on_note("building the runtime's CPU kernels, once per machine (about 15 s)")
    model = kvcalib_runtime.load(path, device=device)
    if chat:
        ids = model.tokenizer.encode(chat_prompt(path, prompt), add_special_tokens=False).ids
    else:
        ids = model.encode(prompt)
    need = model.slots_needed(len(ids), max_new_tokens)  # CapacityError past max_len
    runs = []
    for full in (False, True) if compare else (False,):
        if compare and on_section is not None:
            on_section("full-precision cache" if full else f"{model.meta['recipe']['name']} cache")
        cache = model.new_cache(1, max(need, 1), full_precision=full)
        runs.append(_run(model, ids, cache, max_new_tokens, temperature, top_p, on_text))
    return GenerationReport(
        prompt_tokens=len(ids),
        context=max(need, 1),
        quantized=runs[0],
        full_precision=runs[1] if compare else None,
        dtype=str(model.dtype).removeprefix("torch."),
        long_bytes_per_token=model.kv_bytes_per_token(LONG_CONTEXT),
        long_fp16_bytes_per_token=model.fp16_bytes_per_token(LONG_CONTEXT),
    )


def _run(model, ids, cache, max_new_tokens, temperature, top_p, on_text) -> Run:
    stream = TextStream(model.decode, on_text) if on_text is not None else None
    stamps: list[float] = []

    def step(_, tokens):  # one sequence: tokens[0] is this step's token
        stamps.append(time.perf_counter())
        if stream is not None:
            stream.push(tokens[0])

    start = time.perf_counter()
    [new] = model.generate(
        [ids], max_new_tokens, temperature=temperature, top_p=top_p, callback=step, cache=cache
    )
    if stream is not None:
        stream.close()
    return Run(
        text=model.decode(new),
        new_tokens=len(new),
        prefill_seconds=stamps[0] - start,
        decode_tokens_per_s=(len(new) - 1) / (stamps[-1] - stamps[0]) if len(new) > 1 else None,
        cache_bytes=cache.allocated_bytes(),
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
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except (TemplateError, ArithmeticError, LookupError, TypeError, ValueError) as e:
        # the template's own code: a syntax error, raise_exception(), a missing message or key
        # (jinja2's errors), or a Python error in one of its expressions
        why = " ".join(str(e).split())[:200]
        raise ModelError(
            f"{path}: the folder's chat template fails on one user message ({type(e).__name__}: "
            f"{why}); fix chat_template.jinja (or tokenizer_config.json's chat_template), or "
            "drop --chat"
        ) from None


def _speed(run: Run) -> str:
    return f"{run.decode_tokens_per_s:.1f} tokens/s" if run.decode_tokens_per_s else "n/a"


def format_report(report: GenerationReport) -> str:
    """Speed, then the caches' memory: as allocated for this call (prompt + new tokens, in the
    model's dtype), and per token at LONG_CONTEXT against fp16."""
    q, full_run = report.quantized, report.full_precision
    lines = [
        f"prefill: {report.prompt_tokens} tokens in {q.prefill_seconds:.2f} s; "
        f"decode: {max(q.new_tokens - 1, 0)} tokens at {_speed(q)}",
        f"KV cache allocated for {report.context} tokens ({report.dtype}): "
        f"{q.cache_bytes / MIB:.2f} MiB quantized",
    ]
    if full_run is not None:
        lines[0] += (
            f" (the full-precision cache, {report.dtype}: prefill {full_run.prefill_seconds:.2f} "
            f"s, decode {_speed(full_run)})"
        )
        full = full_run.cache_bytes
        lines[-1] += f" vs {full / MIB:.2f} MiB full precision (ratio {q.cache_bytes / full:.3f})"
    ratio = report.long_bytes_per_token / report.long_fp16_bytes_per_token
    lines.append(
        f"at {LONG_CONTEXT} tokens (fp16): {report.long_bytes_per_token / 1024:.2f} KiB/token "
        f"vs {report.long_fp16_bytes_per_token / 1024:.2f} KiB/token fp16 (ratio {ratio:.3f})"
    )
    return "\n".join(lines)
