"""`kvcalib eval --plots DIR`: the two signals a production team watches, per recipe.

key_error_<recipe>.png   relative key error ||k_hat - k|| / ||k|| by token position (mean
                         over layers, heads and windows): a spike at token 0 means an outlier
                         channel is poisoning its whole vector; later spikes are later sinks
token0_<recipe>.png      mean attention weight on token 0 per layer and head, full precision
                         vs with the recipe: a drop means the sink structure broke
"""

from pathlib import Path

import torch

from kvcalib.simulate import AttentionRecord, Simulator


class Recorder:
    """Accumulates per-position key error and token-0 attention over windows."""

    def __init__(self, model):
        self.model = model
        self.token0 = {}  # name -> [layers, heads] sum of mean token-0 weight
        self.error = {}  # name -> [T] sum of relative key error
        self.windows = {}

    def reference(self, input_ids: torch.Tensor) -> None:
        """Record full precision on one window (an extra forward with explicit attention)."""
        Simulator(self.model, observers=[self.observer("full precision")])(input_ids)

    def observer(self, name: str):
        layers = self.model.config.num_hidden_layers

        def observe(r: AttentionRecord) -> None:
            _, hkv, g, t, _ = r.probs.shape
            if name not in self.token0:
                self.token0[name] = torch.zeros(layers, hkv * g)
                self.error[name] = torch.zeros(t)
                self.windows[name] = 0
            # mean over queries (the first only sees itself) of the weight on key 0
            w0 = r.probs[..., 1:, 0].float().mean((0, -1)).reshape(-1)
            self.token0[name][r.layer] += w0.cpu()
            if r.key_hat is not None:
                err = (r.key_hat - r.key).norm(dim=-1) / r.key.norm(dim=-1).clamp_min(1e-12)
                self.error[name] += err.float().mean((0, 1)).cpu() / layers
            if r.layer == layers - 1:
                self.windows[name] += 1

        return observe

    def write(self, folder: str | Path) -> list[Path]:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        fp = self.token0.get("full precision")
        for name in self.token0:
            if name == "full precision":
                continue
            n = max(self.windows[name], 1)
            safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
            if self.error[name].any():
                fig, ax = plt.subplots(figsize=(8, 3))
                ax.plot((self.error[name] / n).numpy(), lw=0.8)
                ax.set(
                    xlabel="token position",
                    ylabel="relative key error",
                    title=f"{name}: key quantization error by position",
                )
                written.append(_save(fig, folder / f"key_error_{safe}.png"))
            fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
            for ax, (label, data) in zip(
                axes, (("full precision", fp), (name, self.token0[name])), strict=True
            ):
                im = ax.imshow((data / n).numpy(), aspect="auto", vmin=0, vmax=1, cmap="viridis")
                ax.set(title=f"{label}", xlabel="query head", ylabel="layer")
            fig.colorbar(im, ax=axes, label="mean attention on token 0")
            written.append(_save(fig, folder / f"token0_{safe}.png"))
        return written


def _save(fig, path: Path) -> Path:
    from kvcalib.atomic import file_staging

    with file_staging(path) as tmp:
        fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
