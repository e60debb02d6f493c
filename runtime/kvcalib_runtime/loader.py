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

from kvcalib_runtime.errors import CapacityError, KvcalibRuntimeError
from kvcalib_runtime.format import TOKENIZER, Checkpoint, read_checkpoint
from kvcalib_runtime.generate import generate as _generate
from kvcalib_runtime.kernels.layout import use_triton  # plain torch: no triton import
from kvcalib_runtime.model import Transformer

Prompts = str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]] | torch.Tensor


class RuntimeModel:
    """A converted checkpoint ready to generate: the Transformer, its tokenizer and its KV cache.

    model:      the runtime's Transformer (weights on `device`)
    tokenizer:  tokenizers.Tokenizer from tokenizer.json
    config:     config.json; meta: kvcalib.json; scheme: the KVScheme the cache follows
    params:     the calibrated tensors the cache uses (KVParams)
    transforms: where each layer's smoothing and rotations are: fused in the weights or applied
                by the cache (kvcalib_runtime.transforms)
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
        batch = self._token_lists(prompts)
        longest = max(map(len, batch), default=0)
        need = longest + max_new_tokens - 1  # the last new token is never fed back
        if self.max_len is not None and need > self.max_len:
            raise CapacityError(
                f"a prompt of {longest} tokens + max_new_tokens = {max_new_tokens} "
                f"needs {need} cache slots, more than max_len = {self.max_len}: shorten the "
                "prompt, lower max_new_tokens, or load with a larger max_len"
            )
        if eos_token_id is None:
            eos_token_id = self.config.get("eos_token_id")
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
        if isinstance(prompts, torch.Tensor):
            if prompts.dim() != 2 or prompts.dtype.is_floating_point or prompts.is_complex():
                raise KvcalibRuntimeError(
                    f"a tensor of prompts must be integer token ids [batch, tokens], not "
                    f"{prompts.dtype} {list(prompts.shape)}"
                )
            prompts = prompts.tolist()
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]  # one prompt
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append(self.encode(p))
            elif all(isinstance(t, int) and 0 <= t < self.config["vocab_size"] for t in p):
                out.append(list(p))
            else:
                raise KvcalibRuntimeError(
                    f"prompt {str(p)[:60]!r} is neither text nor a list of token ids in "
                    f"[0, {self.config['vocab_size']})"
                )
        return out

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
    max_len:     the longest sequence a generate call may hold (default: the config's
                 max_position_embeddings); every cache is sized to what the call needs
    use_kernels: True / False forces the Triton kernels on or off; None uses them where they run
    Raises FormatError naming the file that is missing, changed or malformed.
    """
    device = _device(device)
    if use_kernels and not use_triton(device):
        raise KvcalibRuntimeError(
            f"use_kernels=True needs a CUDA device or TRITON_INTERPRET=1 (device is {device})"
        )
    path = Path(path)
    ckpt = read_checkpoint(path)
    if max_len is None:
        max_len = ckpt.config.get("max_position_embeddings")
    elif max_len < 1:
        raise KvcalibRuntimeError(f"max_len = {max_len}: use a positive number of tokens")
    model = Transformer.from_folder(path, device=device, dtype=dtype)
    tokenizer = Tokenizer.from_file(str(path / TOKENIZER))
    return RuntimeModel(model, tokenizer, ckpt, max_len=max_len, use_kernels=use_kernels)


def _device(device: str | torch.device | None) -> torch.device:
    """The device to load onto: a valid torch device that this machine has."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise KvcalibRuntimeError(
            f"device {device!r} is not a torch device: use 'cuda', 'cuda:N' or 'cpu'"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KvcalibRuntimeError(f"device {device}: no CUDA device is available; use 'cpu'")
    return device
