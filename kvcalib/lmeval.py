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

Model args (`--model_args NAME=VALUE,...`) are parsed and checked in one place, the table ARGS,
before any model loads: a typo gets "did you mean", a wrong type or range one line naming
NAME=VALUE. The device and the batch size are lm-eval's own options (`--device`, `--batch_size`),
which it passes to every model type: given in --model_args too, they are refused, naming those.
"""

import json
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
from lm_eval.utils import (
    get_rolling_token_windows,
    make_disjoint_window,
    setup_logging,
    simple_parse_args_string,
)
from tqdm.auto import tqdm

from kvcalib.api import ProfileTerms, default_profile
from kvcalib.core import options, preflight
from kvcalib.core.models import load_model, resolve
from kvcalib.core.plan import scheme_with_residual, with_residual
from kvcalib.core.recipe import load_recipe
from kvcalib.errors import DataError, OptionError
from kvcalib.evaluation.longcontext import Prefill, filled_cache
from kvcalib.evaluation.score import Candidate, candidates
from kvcalib.lmeval_args import ARGS, parse_args
from kvcalib_runtime.checkpoint.format import META, read_checkpoint

log = logging.getLogger(__name__)
NAME = "kvcalib"  # the model type: lm-eval --model kvcalib
# The default profile's note and refusals in lm-eval's words
TERMS = ProfileTerms(
    missing="no profile in --model_args",
    give="pass profile=DIR in --model_args",
    stop="profile=DIR in --model_args uses your own instead",
)


@register_model(NAME)
class KvcalibLM(TemplateLM):
    """A kvcalib model spec evaluated through one recipe's cache (see the module docstring);
    its keyword arguments are ARGS'."""

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """As lm-eval's: the --model_args entries (`arg_dict`) and lm-eval's own options
        (`additional_config`: device, batch size), where an own option named in --model_args
        is refused naming lm-eval's option (it would collide with the one lm-eval passes)."""
        for name, value in arg_dict.items():
            option = ARGS[name].option if name in ARGS else None
            if option is not None:
                raise OptionError(
                    f"{name}={value} (--model_args): lm-eval passes the {name} itself; use "
                    f"lm-eval's {option} {value} instead"
                )
        own = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**arg_dict, **own)

    def __init__(self, **given):
        super().__init__()
        args = parse_args(given)
        device, dtype = _device(args["device"]), options.dtype("dtype", args["dtype"])
        trust = args["trust_remote_code"]
        source = resolve(args["pretrained"], trust_remote_code=trust)
        self.max_length, self.max_gen_toks = _lengths(source, args, "max_gen_toks" in given)
        ckpt = read_checkpoint(source.path) if (source.path / META).is_file() else None
        recipe, residual = args["recipe"], args["residual"]
        recipe = "fp16" if recipe is None and ckpt is None else recipe
        loaded = None if recipe is None else load_recipe(recipe)  # a typo fails before the load
        if loaded is not None and residual is not None:
            loaded = with_residual(loaded, residual, "residual=")
        profile = args["profile"]
        if profile is not None or (loaded is not None and loaded.needs_profile):
            profile = default_profile(source, profile, terms=TERMS)
        if loaded is None:  # a converted folder with its own side-car
            name = f"{ckpt.meta['recipe']['name']} (converted)"
            scheme = ckpt.scheme
            if residual is not None:
                scheme = scheme_with_residual(scheme, residual, name, "residual=")
            self.candidate = Candidate(name, None, scheme, ckpt.params, ckpt.transforms)
        else:  # planned on the config, before the load
            config = json.loads((source.path / "config.json").read_text())
            (self.candidate,) = candidates(config, [loaded], profile, ckpt)
        self.model, self.tokenizer = load_model(
            args["pretrained"], device=device, dtype=dtype, trust_remote_code=trust
        )
        c = self.candidate
        self.sink_layers = (
            {c.params.sink_predictor.layer}
            if c.scheme is not None and c.scheme.sink_budget and c.params.sink_predictor
            else set()
        )
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
            if new < 1:
                raise OptionError(
                    f"max_gen_toks {new} (the task's generation_kwargs or --gen_kwargs): use an "
                    "integer >= 1"
                )
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


def _lengths(source, args: dict, gen_toks_given: bool) -> tuple[int, int]:
    """(max_length, max_gen_toks), checked against the model's context (its config.json); a
    max_gen_toks given must leave room for a context (the default is a task's to override,
    checked per request)."""
    context = preflight.max_positions(source)
    max_length = args["max_length"] or context
    if max_length is None:
        raise OptionError(
            f"max_length: {source.spec}'s config.json states no context; pass max_length=N "
            "in --model_args"
        )
    if context and max_length > context:
        raise OptionError(
            f"max_length={max_length} (--model_args): the model reads at most {context} "
            "positions; use at most that"
        )
    if gen_toks_given and args["max_gen_toks"] >= max_length:
        raise OptionError(
            f"max_gen_toks={args['max_gen_toks']} (--model_args): leaves no room for a context "
            f"in max_length {max_length}; use a smaller max_gen_toks"
        )
    return max_length, args["max_gen_toks"]


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
    return options.device("--device", device)


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
