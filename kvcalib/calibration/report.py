"""The human side of a profile: summary lines (`kvcalib inspect`, the top of report.html) and
report.html with its PNG plots (matplotlib's object API with the Agg canvas: no pyplot state)."""

import html

from kvcalib.io.figures import figure


def summary_lines(profile) -> list[str]:
    """The findings of a profile, one topic per line (two for outliers)."""
    m, t = profile.meta, profile.tensors
    model = m["model"]
    lines = [
        f"model        {model['spec']}  ({model['model_type']}, {model['num_layers']} layers, "
        f"{model['num_heads']}/{model['num_kv_heads']} heads, head_dim {model['head_dim']}; "
        f"fingerprint {model['fingerprint'][:16]})",
        f"data         {m['data']}: {m['num_samples']} windows x {m['seq_len']} tokens, "
        f"seed {m['seed']}",
    ]
    token0 = t["attention.token0"].mean(1)
    top = int(token0.argmax())
    lines.append(
        f"token 0      a sink in {m['sinks']['token0_layers']}/{model['num_layers']} layers; "
        f"mean attention on it >= 0.3 in {int((token0 >= 0.3).sum())} layers "
        f"(max {float(token0[top]):.2f}, layer {top})"
    )
    for position, label in (
        ("pre_rope", "outliers     pre-RoPE: "),
        ("post_rope", "             post-RoPE:"),
    ):
        found = [
            (ratio, i, h, c)
            for i, layer in enumerate(m["layers"])
            for h, head in enumerate(layer[f"key_outlier_channels_{position}"])
            for c, ratio in head
        ]
        best = ", ".join(f"L{i} h{h} c{c} x{r:.1f}" for r, i, h, c in sorted(found)[::-1][:4])
        lines.append(
            f"{label} {len(found)} key channels > {m['settings']['outlier_ratio']:g}x "
            f"their head's median range" + (f" (top: {best})" if found else "")
        )
    sinks = m["sinks"]
    tokens = ", ".join(
        f"{e['token']!r} x{e['count']} ({e['weight']:.2f})" for e in sinks["tokens"][:4]
    )
    lines.append(
        f"later sinks  {sinks['count']} positions after token 0 in "
        f"{sinks['later_windows']}/{sinks['windows']} windows" + (f": {tokens}" if tokens else "")
    )
    g = t["position_error.key_groups"][0]  # lowest width, [L, token 0 / later sinks / non-sink]
    parts = []
    for j, name in ((0, "token 0"), (1, "later sinks")):
        ratio = (g[:, j] / g[:, 2]).nan_to_num(0.0)  # no later sinks: no ratio
        top = int(ratio.argmax())
        if ratio[top] > 0:
            parts.append(f"{name} up to {float(ratio[top]):.2f}x (layer {top})")
    lines.append(
        f"key error    {m['position_error_bits'][0]}-bit per-token after RoPE, against "
        "non-sink tokens: " + (", ".join(parts) or "no sinks")
    )
    first = m["massive"]["first_layer"]
    if first is None:
        lines.append(f"massive      no residual dim reaches {m['massive']['ratio']:g}x the median")
    else:
        layer = m["layers"][first]
        dims = ", ".join(f"{d} (x{r:g})" for d, _, r in layer["massive_dims"][:4])
        carriers = ", ".join(repr(text) for text, _ in layer["massive_tokens"][:4])
        lines.append(f"massive      from layer {first}: dims {dims}; carried by {carriers}")
    p = m["sink_predictor"]
    if p is None:
        lines.append("predictor    none (no massive dim separates the sinks)")
    else:
        held = p["held_out"]
        held = f" (held out {held['precision']:.2f} / {held['recall']:.2f})" if held else ""
        lines.append(
            f"predictor    layer {p['layer']}, dims {p['dims']}, |h| > "
            f"{p['threshold']:.1f}: precision {p['precision']:.2f}, recall "
            f"{p['recall']:.2f}{held}"
        )
    for name, label in (
        ("sensitivity", "sensitivity  2-bit KL"),
        ("sensitivity.answer", "             per answer token"),
    ):
        if f"{name}.key" not in t:
            continue
        parts = []
        for tensor in ("key", "value"):
            kl = t[f"{name}.{tensor}"][:, 0]
            parts.append(
                f"{tensor}s max {float(kl.max()):.3g} (layer {int(kl.argmax())}), "
                f"median {float(kl.median()):.3g}"
            )
        lines.append(f"{label}: " + "; ".join(parts))
    if m["codebooks"]:
        c = m["codebooks"]
        lines.append(
            f"codebooks    {len(c['variants'])} variants x {c['bits']} bits, Fisher "
            f"weights from {c['windows']} windows"
        )
    lines.append("timings      " + "  ".join(f"{k} {v:.1f}s" for k, v in m["timings"].items()))
    return lines


def write_report(profile, folder) -> None:
    """report.html and its PNG plots into `folder`."""
    made = [(name, caption) for name, draw, caption in PLOTS if draw(profile, folder / name)]
    summary = "\n".join(summary_lines(profile))
    figures = "\n".join(
        f'<figure><img src="{name}" alt="{name}"><figcaption>{html.escape(caption)}'
        "</figcaption></figure>"
        for name, caption in made
    )
    title = f"kvcalib profile: {html.escape(profile.meta['model']['spec'])}"
    (folder / "report.html").write_text(
        f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{title}</title>\n"
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}"
        "pre{background:#f4f4f4;padding:1em;white-space:pre-wrap}img{max-width:100%}"
        "figcaption{color:#444;margin-bottom:2em}</style></head><body>\n"
        f"<h1>{title}</h1>\n<pre>{html.escape(summary)}</pre>\n{figures}\n</body></html>\n",
        encoding="utf-8",
    )


def _channel_ranges(profile, path) -> bool:
    fig = figure(12, 5)
    axes = fig.subplots(1, 2, sharey=True)
    for ax, kind, label in zip(
        axes, ("key_pre_rope", "key_post_rope"), ("before RoPE", "after RoPE"), strict=True
    ):
        t = profile.tensors
        width = (t[f"{kind}.nonsink.max"] - t[f"{kind}.nonsink.min"]).flatten(1)  # [L, Hkv*D]
        image = ax.imshow(
            width.clamp_min(1e-6).log10().numpy(),
            aspect="auto",
            cmap="magma",
            interpolation="nearest",
        )
        for head in range(1, profile.meta["model"]["num_kv_heads"]):
            ax.axvline(head * profile.meta["model"]["head_dim"] - 0.5, color="w", lw=0.8)
        ax.set_title(f"key channel range {label}")
        ax.set_xlabel("KV head x channel")
        fig.colorbar(image, ax=ax, label="log10 range")
    axes[0].set_ylabel("layer")
    fig.savefig(path, dpi=90)
    return True


def _token0(profile, path) -> bool:
    fig = figure(7, 5)
    ax = fig.subplots()
    image = ax.imshow(
        profile.tensors["attention.token0"].numpy(),
        aspect="auto",
        cmap="viridis",
        vmin=0,
        vmax=1,
        interpolation="nearest",
    )
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.set_title("attention weight on token 0")
    fig.colorbar(image, ax=ax)
    fig.savefig(path, dpi=90)
    return True


def _key_error(profile, path) -> bool:
    fig = figure(12, 4)
    left, right = fig.subplots(1, 2, width_ratios=(3, 2))
    error = profile.tensors["position_error.key"]  # [bits, L, T]
    for bits, row in zip(profile.meta["position_error_bits"], error.mean(1), strict=True):
        left.plot(row.numpy(), label=f"{bits}-bit per-token", lw=0.8)
    left.set_yscale("log")
    left.set_xlabel("position")
    left.set_ylabel("relative key error (mean over layers)")
    left.legend()
    low = error[0]  # the lowest width, per layer, relative to that layer's median position
    image = right.imshow(
        (low / low.median(-1, keepdim=True).values).log2().numpy(),
        aspect="auto",
        cmap="coolwarm",
        vmin=-0.5,
        vmax=0.5,
        interpolation="nearest",
    )
    right.set_xlabel("position")
    right.set_ylabel("layer")
    right.set_title(f"{profile.meta['position_error_bits'][0]}-bit error / layer median")
    fig.colorbar(image, ax=right, label="log2 ratio")
    fig.savefig(path, dpi=90)
    return True


def _massive(profile, path) -> bool:
    fig = figure(10, 4)
    ax = fig.subplots()
    t, layers = profile.tensors, profile.meta["layers"]
    ax.plot(t["massive.median_abs"].numpy(), "k--", label="median |h|")
    ax.plot(t["massive.max_abs"].amax(1).numpy(), "k-", lw=0.8, label="max |h| (any dim)")
    peak = {}
    for layer in layers:
        for d, _, ratio in layer["massive_dims"]:
            peak[d] = max(peak.get(d, 0.0), ratio)
    for d in sorted(peak, key=lambda d: -peak[d])[:8]:
        ax.plot(t["massive.max_abs"][:, d].numpy(), marker=".", lw=0.6, label=f"dim {d}")
    ax.set_yscale("log")
    ax.set_xlabel("layer (output of)")
    ax.set_ylabel("|h|")
    ax.legend(fontsize=7, ncol=2)
    fig.savefig(path, dpi=90)
    return True


def _sensitivity(profile, path) -> bool:
    if "sensitivity.key" not in profile.tensors:
        return False
    bits = profile.meta["probe"]["bits"]
    losses = [("sensitivity", "KL(p_fp || p_q) per token of text", False, bits, None)]
    if "sensitivity.answer.key" in profile.tensors:
        answer = profile.meta["probe"]["answer"]
        measured = answer.get("method") == "probe"
        what = "answer NLL increase" if measured else "KL(p_fp || p_q)"
        screened = answer.get("screened", {}).get("bits")
        losses.append(("sensitivity.answer", f"{what} per answer token", measured,
                       answer.get("widths", bits), screened))  # fmt: skip
    fig = figure(12, 4 * len(losses))
    axes = fig.subplots(len(losses), 2, sharey="row", squeeze=False)
    for row, (name, per, measured, widths, screened) in zip(axes, losses, strict=True):
        for ax, tensor in zip(row, ("key", "value"), strict=True):
            kl = profile.tensors[f"{name}.{tensor}"]
            for j, b in enumerate(bits):
                y = kl[:, j] if measured else kl[:, j].clamp_min(1e-8)
                label = f"{b}-bit" + ("" if b in widths else " (extrapolated)")
                if b == screened:
                    label = f"{b}-bit (a screened third measured, the rest extrapolated)"
                ax.plot(y.numpy(), marker=".", label=label)
            if measured:  # a measured difference: noise around zero, either sign
                ax.set_yscale("symlog", linthresh=1e-3)
            else:
                ax.set_yscale("log")
            ax.set_title(f"only this layer's {tensor}s quantized")
            ax.set_xlabel("layer")
            ax.legend()
        row[0].set_ylabel(per)
    fig.savefig(path, dpi=90)
    return True


PLOTS = (  # file, drawing function (returns False when there is nothing to draw), caption
    ("channel_ranges.png", _channel_ranges,
     "Non-sink range of every key channel (layers x KV head and channel, log scale) before and "
     "after RoPE: outlier channels are bright columns, shared by RoPE with channel j + D/2."),
    ("token0_attention.png", _token0,
     "Mean attention weight on token 0 per layer and query head: where token 0 is the sink."),
    ("key_error_by_position.png", _key_error,
     "Relative key error by position, per-token quantization after RoPE (left: mean over "
     "layers; right: each layer over its median): spikes are keys with outlier channels."),
    ("massive_activations.png", _massive,
     "Largest |h| of the massive residual dims after each layer against the median |h|: what "
     "the sink predictor reads."),
    ("sensitivity.png", _sensitivity,
     "What quantizing only one layer's keys (left) or values (right) by the probe costs: "
     "where bits matter; the KL divergence of the logits per token of the calibration text "
     "(top) and, when calibrated, the loss per answer token of the retrieval prompts (bottom; "
     "measured, it is linear within +-0.001 nats, where a measurement's noise has either sign)."),
)  # fmt: skip
