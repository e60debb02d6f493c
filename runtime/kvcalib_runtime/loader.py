"""Load a kvcalib-converted checkpoint and generate through its quantized KV cache.

    model = kvcalib_runtime.load("converted/", device="cuda")
    [ids] = model.generate("The capital of France is", max_new_tokens=32)
    print(model.decode(ids), model.kv_bytes_per_token(), model.fp16_bytes_per_token())

`load` validates the folder first (`format.read_checkpoint`: format version, manifest sha256,
kvcalib.json, kv_params.safetensors; a FormatError names the file), then reads the weights
straight onto the device (`Transformer.from_folder`). Every `generate` call runs through a fresh
`QuantizedCache` that follows the checkpoint's scheme, one sequence per prompt.
"""

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer

from kvcalib_runtime.checkpoint.checks import context_of
from kvcalib_runtime.checkpoint.format import EXPORT_TENSOR, TOKENIZER, Checkpoint, read_checkpoint
from kvcalib_runtime.errors import CapacityError, FormatError, KvcalibRuntimeError
from kvcalib_runtime.generate import check_options, check_request, is_int
from kvcalib_runtime.generate import generate as _generate
from kvcalib_runtime.kernels import native, use_triton  # plain torch: no triton import
from kvcalib_runtime.model.forward import Transformer

Prompts = str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]] | torch.Tensor


class RuntimeModel:
    """A converted checkpoint ready to generate: the Transformer, its tokenizer and its KV cache.

    model:      the runtime's Transformer (weights on `device`)
    tokenizer:  tokenizers.Tokenizer from tokenizer.json
    config:     config.json; meta: kvcalib.json; scheme: the KVScheme the cache follows
    params:     the calibrated tensors the cache uses (KVParams)
    transforms: where each layer's smoothing and rotations are: fused in the weights or applied
                by the cache (kvcalib_runtime.model.transforms)
    max_len:    the longest sequence (prompt + generated tokens) a generate call may hold, or
                None for no limit
    use_kernels: passed to QuantizedCache (None: Triton where it runs)
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        ckpt: Checkpoint,
        *,
        max_len: int | None,
        use_kernels: bool | None = None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.config, self.meta = ckpt.config, ckpt.meta
        self.scheme, self.params, self.transforms = ckpt.scheme, ckpt.params, ckpt.transforms
        self.max_len, self.use_kernels = max_len, use_kernels
        self.context = context_of(ckpt.geometry)
        attn = model.model.layers[0].self_attn
        self.num_layers = len(model.model.layers)
        self.kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def new_cache(self, batch: int, max_len: int, *, full_precision: bool = False):
        """A QuantizedCache following the checkpoint's scheme for `batch` sequences of up to
        `max_len` tokens, on the model's device and dtype (`full_precision`: the model's
        FullPrecisionCache instead, for comparisons)."""
        if full_precision:
            return self.model.new_cache(batch, max_len)
        return self.model.new_cache(
            batch, max_len, self.scheme, self.params, self.transforms, self.use_kernels
        )

    def slots_needed(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Cache slots per sequence for a prompt of `prompt_tokens` and `max_new_tokens` new
        tokens (the last is never fed back); CapacityError, before anything is allocated, when
        that is more than `max_len`."""
        check_options(max_new_tokens, 0.0, 1.0)
        need = prompt_tokens + max_new_tokens - 1
        if self.max_len is not None and need > self.max_len:
            what = f"a prompt of {prompt_tokens} tokens + max_new_tokens = {max_new_tokens}"
            if self.max_len >= self.context:
                raise CapacityError(
                    f"{what} needs {need} cache slots, more than the model's context of "
                    f"{self.context} tokens: shorten the prompt or lower max_new_tokens"
                )
            raise CapacityError(
                f"{what} needs {need} cache slots, more than max_len = {self.max_len}: shorten "
                f"the prompt, lower max_new_tokens, or load with a larger max_len (up to the "
                f"model's context, {self.context})"
            )
        return need

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (the tokenizer's own special-token rules apply)."""
        return self.tokenizer.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids, special tokens skipped."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def generate(
        self,
        prompts: Prompts,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        eos_token_id: int | Sequence[int] | None = None,
        seed: int | None = None,
        callback: Callable[[int, list[int | None]], None] | None = None,
        cache=None,
    ) -> list[list[int]]:
        """New token ids per prompt (a list per prompt, even for a single prompt).

        prompts:       a str, a list of str, a list of token ids, a list of token-id lists, or
                       an integer tensor [B, T] of token ids (as transformers users pass them);
                       a batch may mix lengths (each prompt is prefilled alone, no padding)
        cache:         the cache to generate through (`new_cache`, batch = len(prompts), large
                       enough); default: a fresh quantized cache of the size the call needs
        eos_token_id:  stop a sequence after one of these; None: config.json's eos_token_id,
                       [] for none
        temperature, top_p, seed, callback: as `kvcalib_runtime.generate.generate`

        Raises CapacityError before any work when the longest prompt plus max_new_tokens does
        not fit in `max_len`.
        """
        check_options(max_new_tokens, temperature, top_p)
        check_request(eos_token_id, seed, callback)
        batch = self._token_lists(prompts)
        if not batch:
            raise KvcalibRuntimeError(
                "no prompts: pass a str, a list of str, or token ids (one list per prompt)"
            )
        need = self.slots_needed(max(map(len, batch), default=0), max_new_tokens)
        if eos_token_id is None:
            eos_token_id = self.config.get("eos_token_id")  # checked at load
        if cache is None:
            cache = self.new_cache(len(batch), max(need, 1))
        elif cache.max_len < need:
            raise CapacityError(
                f"the cache holds {cache.max_len} tokens per sequence; this call needs {need}"
            )
        return _generate(
            self.model,
            batch,
            max_new_tokens,
            cache=cache,
            temperature=temperature,
            top_p=top_p,
            eos_token_id=eos_token_id,
            seed=seed,
            callback=callback,
        )

    def _token_lists(self, prompts: Prompts) -> list[list[int]]:
        if not isinstance(prompts, str | Sequence | torch.Tensor) or isinstance(prompts, bytes):
            raise KvcalibRuntimeError(
                f"prompts = {str(prompts)[:60]!r} ({type(prompts).__name__}): pass a str, a list "
                "of str, a list of token ids, a list of token-id lists or an integer tensor"
            )
        if isinstance(prompts, torch.Tensor):
            if prompts.dim() != 2 or prompts.dtype.is_floating_point or prompts.is_complex():
                raise KvcalibRuntimeError(
                    f"a tensor of prompts must be integer token ids [batch, tokens], not "
                    f"{prompts.dtype} {list(prompts.shape)}"
                )
            prompts = prompts.tolist()
        if isinstance(prompts, str) or (prompts and all(is_int(t) for t in prompts)):
            prompts = [prompts]  # one prompt
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append(self.encode(p))
            elif isinstance(p, Sequence) and not isinstance(p, bytes) and all(map(self._token, p)):
                out.append(list(p))
            else:
                raise KvcalibRuntimeError(
                    f"prompt {str(p)[:60]!r} is neither text nor a list of token ids in "
                    f"[0, {self.config['vocab_size']}): pass text, or ids the model has"
                )
        return out

    def _token(self, t) -> bool:
        return is_int(t) and 0 <= t < self.config["vocab_size"]

    def kv_bytes_per_token(self, context: int = 4096, dtype=torch.float16) -> float:
        """Bytes per token of this checkpoint's quantized cache for one sequence of `context`
        tokens whose exact values are `dtype` (fp16 by default, as served): every buffer such a
        cache allocates (codes, metadata, outlier slots, constants, sink slots, the residual
        window, bookkeeping), walked on a cache planned on the meta device."""
        cache = self.model.new_cache(
            1, context, self.scheme, self.params, self.transforms, False, "meta", dtype
        )
        return cache.bytes_per_token()

    def fp16_bytes_per_token(self, context: int = 4096) -> float:
        """The same for an fp16 cache of the same model."""
        cache = self.model.new_cache(1, context, device="meta", dtype=torch.float16)
        return cache.bytes_per_token()


def load(
    path: str | Path,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    *,
    max_len: int | None = None,
    use_kernels: bool | None = None,
) -> RuntimeModel:
    """Validate and load a converted checkpoint folder (FORMAT.md).

    device:      default "cuda" when available, else "cpu"
    dtype:       weights and cache dtype; None keeps the checkpoint's
    max_len:     the longest sequence a generate call may hold, at most the model's context
                 (the default: the config's max_position_embeddings); every cache is sized to
                 what the call needs
    use_kernels: True / False forces the Triton kernels on or off; None uses them where they run
    Raises FormatError naming the file that is missing, changed or malformed.
    """
    device = _device(device)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise KvcalibRuntimeError(
            f"dtype {dtype!r}: use a floating torch dtype (torch.float16, ...) or None"
        )
    if use_kernels and not use_triton(device):
        raise KvcalibRuntimeError(
            f"use_kernels=True needs a CUDA device or TRITON_INTERPRET=1 (device is {device})"
        )
    native_cpu = _cpu_path(device, use_kernels) and native.enabled()  # KVCALIB_NATIVE checked
    path = Path(path)
    ckpt = read_checkpoint(path)
    context = context_of(ckpt.geometry)
    if max_len is None:
        max_len = context
    elif not isinstance(max_len, int) or isinstance(max_len, bool) or not 1 <= max_len <= context:
        raise CapacityError(
            f"max_len = {max_len!r}: use a number of tokens in [1, {context}], the model's context"
        )
    tokenizer = read_tokenizer(path, ckpt.geometry.vocab)
    model = Transformer.from_folder(path, device=device, dtype=dtype)
    if native_cpu:
        native.library()  # built here once per machine (kernels/native.py), not in a decode step
    return RuntimeModel(model, tokenizer, ckpt, max_len=max_len, use_kernels=use_kernels)


def check_servable(
    config: dict, shapes: dict[str, tuple[int, ...]], scheme, params, transforms
) -> None:
    """FormatError for what `load` and `generate` would refuse in a checkpoint with this
    config.json, these weight names and shapes, and this side-car — without reading a weight:
    a converter calls it before it writes a byte. Builds the Transformer and a quantized cache
    on the meta device."""
    with torch.device("meta"):
        model = Transformer(config)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    found = {n: tuple(s) for n, s in shapes.items() if not EXPORT_TENSOR.fullmatch(n)}
    if model.tied:
        found.pop("lm_head.weight", None)
    for name in sorted(expected.keys() ^ found.keys()):
        where = "lacks" if name in expected else "holds the unknown"
        raise FormatError(f"the weights {where} tensor {name!r} of a {config['model_type']} model")
    for name, shape in sorted(found.items()):
        if shape != expected[name]:
            raise FormatError(
                f"tensor {name!r} has shape {list(shape)}, config.json implies "
                f"{list(expected[name])}"
            )
    context = min(context_of(model.geometry), 64)
    model.new_cache(1, context, scheme, params, transforms, False, "meta", torch.float16)


def read_tokenizer(path: Path, vocab: int) -> Tokenizer:
    """The folder's tokenizer.json, refused (FormatError) when the tokenizers library cannot read
    it or it has more tokens than the `vocab` rows of the embedding."""
    try:
        tokenizer = Tokenizer.from_file(str(path / TOKENIZER))
    except Exception as e:  # the tokenizers library raises plain Exception on a bad file
        raise FormatError(
            f"{TOKENIZER}: not a tokenizer the tokenizers library reads ({e}); copy the source "
            "model's tokenizer.json and convert again"
        ) from None
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > vocab:
        raise FormatError(
            f"{TOKENIZER}: {size} tokens, but config.json's vocab_size is {vocab}: ids past the "
            "embedding; convert with the model's own tokenizer"
        )
    return tokenizer


def builds_cpu_kernels(device: str | torch.device | None = None, use_kernels=None) -> bool:
    """True when `load(..., device, use_kernels=use_kernels)` would first compile the runtime's
    CPU kernels (kernels/native.py: 15-17 s of CPU, once per machine)."""
    return _cpu_path(_device(device), use_kernels) and native.pending()


def _cpu_path(device: torch.device, use_kernels: bool | None) -> bool:
    """Whether a model on `device` decodes through the CPU path (decode_torch and the C
    kernels) rather than Triton's."""
    return device.type == "cpu" and not (use_triton(device) if use_kernels is None else use_kernels)


def _device(device: str | torch.device | None) -> torch.device:
    """The device to load onto: a valid torch device that this machine has."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise KvcalibRuntimeError(
            f"device {str(device)!r} is not one the runtime serves on: use 'cuda', 'cuda:N' or "
            "'cpu'"
        )
    device = parsed
    if device.type == "cpu" and device.index not in (None, 0):
        raise KvcalibRuntimeError(f"device {device}: there is one CPU device; use 'cpu'")
    if device.type == "cpu":
        return torch.device("cpu")  # cpu:0 too, which safetensors does not take
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KvcalibRuntimeError(f"device {device}: no CUDA device is available; use 'cpu'")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise KvcalibRuntimeError(
            f"device {device}: this machine has {torch.cuda.device_count()} CUDA device(s); "
            "use cuda:0 to cuda:N-1"
        )
    return device
