"""`kvcalib eval --plots DIR`: the two signals a production team watches, per recipe.

key_error_<recipe>.png   relative key error ||k_hat - k|| / ||k|| by token position, as the last
                         query of a window sees the keys (mean over layers, heads and windows):
                         positions the recipe keeps exact there (kept sinks, and in decode mode
                         the residual window) are drawn as exact — zero error, marked — not as
                         quantization error. A spike at token 0 means an outlier channel poisons
                         its whole vector; later spikes are later sinks
token0_<recipe>.png      mean attention weight on token 0 per layer and query head: full
                         precision, with the recipe, and their difference (recipe - full
                         precision): a drop means the sink structure broke
"""

from pathlib import Path

import torch

from kvcalib.io.figures import figure, save_png
from kvcalib.sim.simulate import AttentionRecord, Simulator

REFERENCE = "full precision"


class Recorder:
    """Accumulates per-position key error and token-0 attention over windows."""

    def __init__(self, model):
        self.model = model
        self.token0 = {}  # name -> [layers, heads] sum of mean token-0 weight
        self.error = {}  # name -> [T] sum of relative key error
        self.exact = {}  # name -> [T] how often the position was exact for the last query
        self.windows = {}

    def reference(self, input_ids: torch.Tensor) -> None:
        """Record full precision on one window (an extra forward with explicit attention)."""
        Simulator(self.model, observers=[self.observer(REFERENCE)])(input_ids)

    def observer(self, name: str):
        layers = self.model.config.num_hidden_layers

        def observe(r: AttentionRecord) -> None:
            _, hkv, g, t, _ = r.probs.shape
            if name not in self.token0:
                self.token0[name] = torch.zeros(layers, hkv * g)
                self.error[name] = torch.zeros(t)
                self.exact[name] = torch.zeros(t)
                self.windows[name] = 0
            # mean over queries (the first only sees itself) of the weight on key 0
            w0 = r.probs[..., 1:, 0].float().mean((0, -1)).reshape(-1)
            self.token0[name][r.layer] += w0.cpu()
            if r.key_hat is not None:
                err = (r.key_hat - r.key).norm(dim=-1) / r.key.norm(dim=-1).clamp_min(1e-12)
                err = err.float().masked_fill(r.key_exact[:, None], 0.0)
                self.error[name] += err.mean((0, 1)).cpu() / layers
                self.exact[name] += r.key_exact.float().mean(0).cpu() / layers
            if r.layer == layers - 1:
                self.windows[name] += 1

        return observe

    def write(self, folder: str | Path) -> list[Path]:
        """Both plots of every recorded recipe into `folder`; returns the files written."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        fp = self.token0[REFERENCE] / max(self.windows[REFERENCE], 1)
        for name in self.token0:
            if name == REFERENCE:
                continue
            n = max(self.windows[name], 1)
            safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
            if self.error[name].any():
                written.append(self._key_error(name, n, folder / f"key_error_{safe}.png"))
            written.append(self._token0(name, fp, n, folder / f"token0_{safe}.png"))
        return written

    def _key_error(self, name: str, n: int, path: Path) -> Path:
        fig = figure(8, 3)
        ax = fig.subplots()
        error, exact = (self.error[name] / n).numpy(), (self.exact[name] / n) > 0.5
        ax.plot(error, lw=0.8, label="quantized")
        where = exact.nonzero().flatten().numpy()
        if len(where):
            ax.plot(where, error[where], "o", ms=2.5, color="tab:green", label="kept exact")
        ax.set(
            xlabel="token position",
            ylabel="relative key error",
            title=f"{name}: key error by position, as the last query sees it",
        )
        ax.legend(loc="upper right", fontsize="small")
        return save_png(fig, path, dpi=110)

    def _token0(self, name: str, fp: torch.Tensor, n: int, path: Path) -> Path:
        fig = figure(14, 4)
        axes = fig.subplots(1, 3, sharey=True)
        recipe = self.token0[name] / n
        for ax, label, data in ((axes[0], REFERENCE, fp), (axes[1], name, recipe)):
            im = ax.imshow(data.numpy(), aspect="auto", vmin=0, vmax=1, cmap="viridis")
            ax.set(title=label, xlabel="query head", ylabel="layer")
        fig.colorbar(im, ax=axes[:2], label="mean attention on token 0")
        diff = recipe - fp
        bound = max(float(diff.abs().max()), 1e-6)
        im = axes[2].imshow(diff.numpy(), aspect="auto", vmin=-bound, vmax=bound, cmap="RdBu_r")
        axes[2].set(title=f"{name} - {REFERENCE}", xlabel="query head")
        fig.colorbar(im, ax=axes[2], label="difference")
        return save_png(fig, path, dpi=110)
