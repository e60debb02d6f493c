"""A causal LM run one decoder layer at a time: what calibration runs on, with the weights in
memory (`InMemory`) or read from the safetensors shards only while their layer runs
(`LayerwiseModel`, for models that do not fit).

    lm = LayerwiseModel(source, device="cpu", dtype=torch.float32)   # or InMemory(model)
    with lm.embedding():
        hidden, kwargs = lm.inputs(ids)          # layer 0's input [B, T, E], every layer's kwargs
    for i in range(lm.config.num_hidden_layers):
        with lm.layer(i) as layer:               # loaded from the shards, freed (back to meta)
            hidden = layer(hidden, **kwargs[i])
    with lm.head():
        logits = lm.logits(hidden)               # final norm + lm_head, as the model computes

Both keep the model's own modules, hooks and attention dispatch, so the Simulator runs on them
unchanged. The model's own forward, with each decoder layer's forward replaced by a recorder,
supplies exactly the arguments it would pass each layer (mask, RoPE, positions) and computes the
head; the decoder layers are called directly. The same layer on the same inputs runs the same
kernels, so the outputs equal a whole-model forward's bit for bit. `windows_per_load` is how many
calibration windows go through a layer each time it is loaded: one in memory (window by window,
little held between layers), all of them from shards (each layer read once per pass).

`LayerwiseModel` builds the model from its config with every parameter on the meta device (its
buffers, RoPE's inverse frequencies, are real). `ActivationStore` holds what flows between
layers, in memory or in files (`--offload-dir`). `fits_in_memory` is the rule that chooses the
layer-by-layer path.
"""

import contextlib
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import psutil
import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM

from kvcalib.errors import ModelError
from kvcalib.io.atomic import full_disk, full_disk_error
from kvcalib.io.shards import SourceWeights
from kvcalib.sim.hooks import decoder_layers
from kvcalib_runtime.model import archs

HEADROOM = 1.25  # in-memory calibration needs the weights plus about this much for activations


class _Captured(Exception):
    pass


class LayerSource:
    """What calibration needs of a causal LM, one decoder layer at a time; see above.

    model (the transformers module), config, device, dtype, kvcalib_source, windows_per_load
    (None: all windows)."""

    model: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    windows_per_load: int | None

    def embedding(self):
        """Context: the input embedding loaded (for `inputs`)."""
        raise NotImplementedError

    def head(self):
        """Context: the final norm and the output embedding loaded (for `logits`)."""
        raise NotImplementedError

    def layer(self, i: int):
        """Context: decoder layer i loaded; yields the module."""
        raise NotImplementedError

    @property
    def config(self):
        return self.model.config

    @property
    def kvcalib_source(self):
        return self.model.kvcalib_source

    def chunks(self, n: int) -> list[range]:
        """Windows 0 ... n - 1 in the groups that go through each layer per load."""
        step = self.windows_per_load or n
        return [range(s, min(s + step, n)) for s in range(0, n, step)]

    def work(self) -> tuple[int, int]:
        """(parameters of one decoder layer, of the head): what a step through either costs,
        for progress bars weighted by work (meta parameters count too)."""
        layer = sum(p.numel() for p in decoder_layers(self.model)[0].parameters())
        return layer, self.model.get_output_embeddings().weight.numel()

    def inputs(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[dict]]:
        """Layer 0's input [B, T, E] for ids [B, T] and the keyword arguments of every layer,
        under the attention implementation in effect (a Simulator's, inside its `layerwise`).
        Needs `embedding()`."""
        return self._run(record=True, input_ids=ids.to(self.device))

    def layer_kwargs(self, batch: int, seq_len: int) -> list[dict]:
        """Every layer's keyword arguments for inputs [batch, seq_len] (they depend on the shape
        alone: calibration windows are never padded). Loads nothing."""
        zeros = torch.zeros(
            batch, seq_len, self.config.hidden_size, dtype=self.dtype, device=self.device
        )
        return self._run(record=True, inputs_embeds=zeros)[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head on the last layer's output: hidden [B, T, E] -> logits [B, T, V], as the
        model computes it (gradients flow to `hidden`). Needs `head()`."""
        return self._run(record=False, inputs_embeds=hidden.to(self.device))

    def _run(self, *, record: bool, **inputs):
        """The model's own forward with every decoder layer passing its input through: with
        `record`, stop at the last layer -> (layer 0's input, [kwargs per layer]); else the
        logits."""
        layers = decoder_layers(self.model)
        seen = []

        def passthrough(i: int):
            def forward(hidden_states, **kwargs):
                seen.append((hidden_states, kwargs))
                if record and i == len(layers) - 1:
                    raise _Captured
                return hidden_states

            return forward

        own = [layer.__dict__.get("forward") for layer in layers]  # accelerate wraps forward
        for i, layer in enumerate(layers):
            layer.forward = passthrough(i)
        try:
            with contextlib.suppress(_Captured):  # use_cache=False: no KV cache object at all
                logits = self.model(**inputs, use_cache=False).logits
        finally:
            for layer, forward in zip(layers, own, strict=True):
                del layer.forward
                if forward is not None:
                    layer.forward = forward
        return (seen[0][0], [kwargs for _, kwargs in seen]) if record else logits


class InMemory(LayerSource):
    """A loaded transformers causal LM (eval mode) as a LayerSource: loading is a no-op and
    windows go through the whole model one at a time."""

    windows_per_load = 1

    def __init__(self, model: torch.nn.Module):
        self.model = model
        param = next(model.parameters())
        self.device = model.get_input_embeddings().weight.device
        self.dtype = param.dtype

    def embedding(self):
        return contextlib.nullcontext()

    def head(self):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def layer(self, i: int):
        yield decoder_layers(self.model)[i]


class LayerwiseModel(LayerSource):
    """A causal LM of a local Hugging Face folder with its weights left on disk; see above."""

    windows_per_load = None

    def __init__(
        self,
        source,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        trust_remote_code: bool = False,
    ):

        self.device = torch.device(resolve_device(device))
        self.dtype = dtype
        self.weights = SourceWeights(source.path)
        config = AutoConfig.from_pretrained(source.path, trust_remote_code=trust_remote_code)
        with init_empty_weights():  # parameters on meta; buffers real, on the CPU
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, trust_remote_code=trust_remote_code
            )
        model.eval()
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                module._buffers[name] = buf.to(self.device)
        model.kvcalib_source = source
        self.model = model
        self._modules = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        for name, _ in model.named_parameters(remove_duplicate=False):
            self._checkpoint_name(name)  # a missing tensor fails now, not after minutes

    # -- weights in and out ------------------------------------------------------------------------

    def embedding(self):
        return self._loaded(self.model.get_input_embeddings())

    def head(self):
        norm = self.model.get_submodule(archs.FINAL_NORM)
        return self._loaded(norm, self.model.get_output_embeddings())

    @contextlib.contextmanager
    def layer(self, i: int):
        layer = decoder_layers(self.model)[i]
        with self._loaded(layer):
            yield layer

    @contextlib.contextmanager
    def _loaded(self, *modules):
        params = []  # (module, attribute, full name)
        for module in modules:
            prefix = self._modules[id(module)]
            for name, _ in module.named_parameters(remove_duplicate=False):
                owner, _, attr = f"{prefix}.{name}".rpartition(".")
                params.append((self.model.get_submodule(owner), attr, f"{prefix}.{name}"))
        names = [self._checkpoint_name(full) for _, _, full in params]
        tensors = self.weights.read(sorted(set(names)))
        meta = {}
        try:
            for (owner, attr, _), name in zip(params, names, strict=True):
                old = owner._parameters[attr]
                meta[owner, attr] = old
                value = tensors[name].to(self.device, old.dtype)
                owner._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
            del tensors
            yield
        finally:
            for (owner, attr), old in meta.items():
                owner._parameters[attr] = old  # back to meta: the memory is freed

    def _checkpoint_name(self, name: str) -> str:
        """The checkpoint tensor behind parameter `name` (a tied output embedding reads the
        input embedding's)."""
        if name in self.weights.entries:
            return name
        out = self.model.get_output_embeddings()
        embed = self._modules[id(self.model.get_input_embeddings())] + ".weight"
        tied = getattr(self.config, "tie_word_embeddings", False) or (
            hasattr(self.config, "get_text_config")
            and getattr(self.config.get_text_config(), "tie_word_embeddings", False)
        )
        if (
            out is not None
            and name == self._modules[id(out)] + ".weight"
            and tied
            and embed in self.weights.entries
        ):
            return embed
        raise ModelError(
            f"model {self.weights.folder}: no tensor {name} in its safetensors files, which "
            "sequential calibration reads by the model's own parameter names; calibrate in "
            "memory (--in-memory)"
        )


class ActivationStore:
    """Tensors kept between layers, by key: on the CPU, or with `folder` one file each in a
    temporary folder inside it (removed by `close`), so memory holds only what is in use."""

    def __init__(self, folder: str | Path | None = None):
        self.dir = self.folder = None
        self._made = []  # the folders it made for `folder`, innermost first: removed by close
        if folder is not None:
            self.folder = Path(folder)
            self._made = [p for p in (self.folder, *self.folder.parents) if not p.exists()]
            self.folder.mkdir(parents=True, exist_ok=True)
            self.dir = Path(tempfile.mkdtemp(prefix="kvcalib-offload-", dir=folder))
        self._items = {}  # key -> tensor, or (file, shape, dtype)
        self._files = 0

    def put(self, key, tensor: torch.Tensor) -> None:
        t = tensor.detach().cpu()
        if self.dir is None:
            self._items[key] = t
            return
        self.pop(key)
        self._files += 1
        path = self.dir / f"{self._files}.bin"
        try:
            path.write_bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        except OSError as e:
            if full_disk(e):
                raise full_disk_error("--offload-dir", self.folder) from None
            raise
        self._items[key] = (path, t.shape, t.dtype)

    def get(self, key) -> torch.Tensor:
        item = self._items[key]
        if isinstance(item, torch.Tensor):
            return item
        path, shape, dtype = item
        return torch.from_numpy(np.fromfile(path, dtype=np.uint8)).view(dtype).view(shape)

    def pop(self, key) -> torch.Tensor | None:
        if key not in self._items:
            return None
        t = self.get(key)
        item = self._items.pop(key)
        if not isinstance(item, torch.Tensor):
            item[0].unlink()
        return t

    def __contains__(self, key) -> bool:
        return key in self._items

    def close(self) -> None:
        self._items.clear()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        for p in self._made:  # only the empty ones
            with contextlib.suppress(OSError):
                p.rmdir()

    def __enter__(self) -> "ActivationStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def resolve_device(device: str | torch.device) -> str:
    """`auto` -> "cuda" when a GPU is visible, else "cpu"; anything else unchanged."""
    if str(device) == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(device)


def weight_bytes(folder: Path, dtype: torch.dtype) -> int:
    """Bytes of a folder's weights once loaded: floating tensors in `dtype`, others as stored."""
    total = 0
    for _, shape, stored in SourceWeights(folder).entries.values():
        item = dtype.itemsize if stored.is_floating_point else stored.itemsize
        total += int(np.prod(shape, dtype=np.int64)) * item
    return total


def available_bytes(device: str | torch.device) -> int:
    """Memory free for a model on `device`: RAM the OS can give (psutil's "available"), or the
    free memory of the GPU ("auto": of every visible GPU, as device_map="auto" spreads it)."""
    device = str(device)
    if device == "auto" and torch.cuda.is_available():
        return sum(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]

    return psutil.virtual_memory().available


def fits_in_memory(folder: Path, dtype: torch.dtype, device, *, quiet: bool = False) -> bool:
    """Whether the whole model loads on `device` with HEADROOM to spare; says on stderr when it
    does not (the caller then calibrates layer by layer)."""
    need, free = weight_bytes(folder, dtype), available_bytes(device)
    fits = need * HEADROOM <= free
    if not fits and not quiet:
        print(
            f"kvcalib: the model needs {need / 2**30:.1f} GiB in {str(dtype)[6:]} and "
            f"{free / 2**30:.1f} GiB is free on {device}: calibrating layer by layer "
            "(--sequential)",
            file=sys.stderr,
        )
    return fits
