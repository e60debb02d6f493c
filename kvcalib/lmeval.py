"""lm-evaluation-harness's tasks through any recipe's cache: the `kvcalib` model type.

    kvcalib lm-eval --model kvcalib --model_args pretrained=smollm2-135m,recipe=kvcalib-2 \\
        --tasks niah_single_1,niah_multikey_2 --metadata '{"max_seq_lengths":[2048]}' --limit 10

Decode mode, as a serving runtime runs a recipe: a request's context is prefilled once in full
precision (`longcontext.Prefill`) and stored into the recipe's cache (`longcontext.filled_cache`);
every generated token (`generate_until`, greedy) and every continuation token, teacher-forced
(`loglikelihood`, `loglikelihood_rolling`), then runs through that cache one token at a time, so
it attends to the context as the recipe stores it. Recipe "fp16" is full precision.

lm-eval 0.4.13 finds a model type only in its registry (`lm_eval.api.registry`; it reads no
entry points), so "kvcalib" exists once this module is imported: `kvcalib lm-eval ARGS` imports
it and runs lm-eval's own command line with ARGS. RULER's synthetic tasks load their tokenizer by
the name in `pretrained` (or metadata "tokenizer"); a kvcalib spec such as smollm2-135m is no hub
id, so `kvcalib lm-eval` hands them the resolved local folder as metadata "tokenizer"
(`task_metadata`; from Python, pass it to `lm_eval.simple_evaluate(metadata=...)`).

Model args: pretrained (a kvcalib model spec or path; a converted folder runs its own side-car
unless a recipe is named), recipe (name or TOML; default fp16), profile (default: the model's
default calibration, when the recipe needs one), residual (the window every recipe is given:
128, as the project's tables; none keeps the recipe's own), dtype (float32), device, max_length
(default: the model's context), max_gen_toks (256), batch_size (1 only).
"""

import logging
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from lm_eval._cli import HarnessCLI
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, setup_logging
from tqdm.auto import tqdm

from kvcalib.api import default_profile
from kvcalib.core import options
from kvcalib.core.models import load_model, resolve
from kvcalib.core.plan import scheme_with_residual
from kvcalib.core.recipe import load_recipe
from kvcalib.errors import DataError, OptionError
from kvcalib.evaluation.longcontext import Prefill, filled_cache
from kvcalib.evaluation.score import Candidate, candidates
from kvcalib_runtime.checkpoint.format import META, read_checkpoint

log = logging.getLogger(__name__)
NAME = "kvcalib"  # the model type: lm-eval --model kvcalib
RESIDUAL = 128  # the window every recipe is given by default, as in the project's tables


@register_model(NAME)
class KvcalibLM(TemplateLM):
    """A kvcalib model spec evaluated through one recipe's cache (see the module docstring)."""

    def __init__(
        self,
        pretrained: str | None = None,
        recipe: str | None = None,
        profile: str | None = None,
        residual: int | None = RESIDUAL,
        dtype: str = "float32",
        device: str = "cpu",
        max_length: int | None = None,
        max_gen_toks: int = 256,
        batch_size: int | str = 1,
        trust_remote_code: bool = False,
    ):
        super().__init__()
        if str(batch_size) != "1":
            raise OptionError(
                f"batch_size {batch_size}: the kvcalib model type runs one request at a time "
                "(each through its own cache); use --batch_size 1"
            )
        source = resolve(pretrained, trust_remote_code=trust_remote_code)
        ckpt = read_checkpoint(source.path) if (source.path / META).is_file() else None
        if recipe is None and ckpt is None:
            recipe = "fp16"
        loaded = None if recipe is None else load_recipe(recipe)  # a typo fails before the load
        if profile is not None or (loaded is not None and loaded.needs_profile):
            profile = default_profile(source, profile)
        self.model, self.tokenizer = load_model(
            pretrained,
            device=_device(device),
            dtype=options.dtype("dtype", dtype),
            trust_remote_code=trust_remote_code,
        )
        if loaded is None:  # a converted folder with its own side-car
            name = f"{ckpt.meta['recipe']['name']} (converted)"
            scheme = ckpt.scheme
            if residual is not None:
                scheme = scheme_with_residual(scheme, residual, name)
            self.candidate = Candidate(name, None, scheme, ckpt.params, ckpt.transforms)
        else:
            (self.candidate,) = candidates(self.model, [loaded], profile, ckpt, residual=residual)
        c = self.candidate
        self.sink_layers = (
            {c.params.sink_predictor.layer}
            if c.scheme is not None and c.scheme.sink_budget and c.params.sink_predictor
            else set()
        )
        context = getattr(self.model.config, "max_position_embeddings", None)
        self.max_length = int(max_length or context)
        if context and self.max_length > context:
            raise OptionError(
                f"max_length {max_length}: the model reads at most {context} positions; use "
                "at most that"
            )
        self.max_gen_toks = int(max_gen_toks)
        self._device = next(self.model.parameters()).device

    # Tokenization, as lm-eval's HF model does it

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context stands for: BOS, else the end of text."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list:
        """Token ids of `string`; None: the tokenizer's own special tokens, unless the string
        starts with BOS already."""
        bos = self.tokenizer.bos_token
        if add_special_tokens is None and bos and string.startswith(bos):
            add_special_tokens = False
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer(string, **special)["input_ids"]

    def apply_chat_template(self, chat_history: list, add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    # The requests

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list:
        """(sum of log p, whether greedy decoding gives the continuation) per
        ((context, continuation), context ids, continuation ids)."""
        out = []
        for key, context, continuation in tqdm(
            requests, desc="loglikelihood through the cache", disable=disable_tqdm
        ):
            out.append(self.score(context, continuation))
            self.cache_hook.add_partial("loglikelihood", key, out[-1])
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each text, in windows of max_length tokens as lm-eval's HF
        model cuts them (each window's context prefilled, its new tokens decoded)."""
        out = []
        for (text,) in tqdm(
            [r.args for r in requests], desc="rolling loglikelihood", disable=disable_tqdm
        ):
            windows = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            total = 0.0
            for window in windows:
                context, continuation = make_disjoint_window(window)
                total += self.score(list(context), list(continuation))[0]
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations through the cache, cut at the first stop sequence (the end of
        text among them), at most max_gen_toks tokens."""
        eot = self.eot_token_id
        eos = None if eot is None else self.tokenizer.decode([eot])
        out = []
        for context, gen_kwargs in tqdm(
            [r.args for r in requests], desc="generate through the cache", disable=disable_tqdm
        ):
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise OptionError(
                    f"gen_kwargs {gen_kwargs}: the kvcalib model type decodes greedily; use "
                    "do_sample=false"
                )
            until = handle_stop_sequences(kwargs.get("until"), eos=eos)
            new = kwargs["max_gen_toks"]
            if new >= self.max_length:
                raise OptionError(
                    f"max_gen_toks {new}: leaves no room for a context in max_length "
                    f"{self.max_length}; use a smaller max_gen_toks"
                )
            ids = self.tok_encode(context)[-(self.max_length - new) :]
            text = self.generate(ids, new, until)
            out.append(postprocess_generated_text(text, stop=until, think_end_token=None))
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), out[-1])
        return out

    # Through the recipe's cache

    def _step(self, cache, token: int) -> torch.Tensor:
        """The next-token logits [V] after `token`, which is stored into `cache`."""
        x = torch.tensor([[token]], device=self._device)
        return self.model(x, cache=cache, use_cache=True).logits[0, -1]

    @torch.no_grad()
    def score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """log p(continuation | context) through the cache, and whether every continuation
        token is the greedy one. The context is left-truncated so that context and
        continuation fit in max_length + 1 tokens (the last one is never fed)."""
        assert context, "lm-eval gives every continuation a context (the prefix token at least)"
        keep = self.max_length + 1 - len(continuation)
        if keep < 1:
            raise DataError(
                f"a continuation of {len(continuation)} tokens after {len(context)} context "
                f"tokens: the model reads at most max_length {self.max_length}; raise max_length"
            )
        context = context[-keep:]
        prefill = Prefill(
            self.model, torch.tensor([context], device=self._device), self.sink_layers
        )
        steps = [prefill.logits]
        with filled_cache(
            self.model, self.candidate, prefill, len(context) + len(continuation)
        ) as c:
            steps += [self._step(c, token) for token in continuation[:-1]]
        logp = F.log_softmax(torch.stack(steps).float(), -1)  # [C, V]
        target = torch.tensor(continuation, device=logp.device)
        total = logp.gather(-1, target[:, None]).sum().item()
        return total, bool((logp.argmax(-1) == target).all())

    @torch.no_grad()
    def generate(self, context: list[int], max_new: int, until: Sequence[str]) -> str:
        """Greedy text after `context` through the cache: up to `max_new` tokens, the end of
        text, or a stop sequence in `until` (left in the text)."""
        prefill = Prefill(
            self.model, torch.tensor([context], device=self._device), self.sink_layers
        )
        logits, tokens = prefill.logits, []
        with filled_cache(self.model, self.candidate, prefill, len(context) + max_new) as cache:
            while len(tokens) < max_new:
                token = int(logits.argmax())
                if token == self.eot_token_id:
                    break
                tokens.append(token)
                text = self.tokenizer.decode(tokens)
                if len(tokens) == max_new or any(s and s in text for s in until):
                    break
                logits = self._step(cache, token)
        return self.tokenizer.decode(tokens)


def _device(device: str) -> str:
    """The device to load on: `device`, or the CPU where it names CUDA on a machine without
    one (lm-eval's command line passes cuda:0 unless told --device; its HF model falls back
    the same way)."""
    try:
        wanted = torch.device(str(device))
    except (RuntimeError, TypeError):
        wanted = None
    if wanted is not None and wanted.type == "cuda" and not torch.cuda.is_available():
        log.warning("device %s: no CUDA device on this machine, running on the CPU", device)
        return "cpu"
    return options.device("device", device)


def task_metadata(model_args: dict, metadata: dict | None, *, trust_remote_code=False) -> dict:
    """lm-eval task metadata with "tokenizer": the local folder of model_args' `pretrained`
    (what RULER's tasks load by name; a kvcalib spec names no hub repository), unless the
    metadata or the model args name a tokenizer already."""
    metadata = dict(metadata or {})
    if "tokenizer" in metadata or "tokenizer" in model_args:
        return metadata
    source = resolve(model_args.get("pretrained"), trust_remote_code=trust_remote_code)
    return {**metadata, "tokenizer": str(source.path)}


def run_cli(argv: Sequence[str]) -> None:
    """lm-eval's own command line (`lm_eval ARGS`) with the kvcalib model type registered and,
    for --model kvcalib, the tokenizer in the task metadata (`task_metadata`)."""
    setup_logging()
    cli = HarnessCLI()
    saved, sys.argv = sys.argv, ["lm-eval", *argv]
    try:
        args = cli.parse_args()  # reads sys.argv, inserting `run` when no subcommand is named
    finally:
        sys.argv = saved
    if getattr(args, "model", None) == NAME:
        model_args = args.model_args or {}
        trust = bool(model_args.get("trust_remote_code", False))
        args.metadata = task_metadata(model_args, args.metadata, trust_remote_code=trust)
    cli.execute(args)


__all__ = ["NAME", "KvcalibLM", "run_cli", "task_metadata"]
