"""How fast and how lean `kvcalib convert` streams a checkpoint, against a plain copy.

    python benchmarks/bench_convert.py                 # ~2 GB synthetic fp16 Llama, sharded
    python benchmarks/bench_convert.py --size-gb 8 --residual

Builds a random Llama checkpoint (hidden 2048, GQA 16/4 heads, head_dim 128, intermediate 5632,
vocab 32000; as many layers as the size asks) in fp16 shards, then times, each in a fresh
subprocess whose peak RSS is read with getrusage(RUSAGE_CHILDREN) by a wrapper process:

  import    python + torch + kvcalib imported, nothing else (the floor of every row)
  copy      safetensors load_file + save_file of every shard (what any tool pays to rewrite)
  convert   kvcalib.convert with a value-rotation recipe (quarot-kv4), default 5GB shards
  +resid    the same with --rotate-residual (every weight multiplied by a Hadamard)

Every task runs `--repeats` times after one warm-up read of the source, so the page cache is
warm for all; the best wall time and the largest RSS are reported. Targets: convert within
1.5x the copy's time; convert's RSS within one decoder layer + 1 GiB of the import floor.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 2048, 16, 4, 128, 5632, 32000


def _layer_params() -> int:
    attn = 2 * HIDDEN * HEADS * HEAD_DIM + 2 * HIDDEN * KV_HEADS * HEAD_DIM
    return attn + 3 * HIDDEN * INTER + 2 * HIDDEN


def build(folder: Path, size_gb: float, shard_mb: int) -> int:
    """Write a random fp16 Llama of about size_gb, in shards of shard_mb; returns its layers."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    layers = max(1, round((size_gb * 1e9 / 2 - 2 * VOCAB * HIDDEN) / _layer_params()))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "num_hidden_layers": layers, "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "dtype": "float16",
    }  # fmt: skip
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": (INTER, HIDDEN),
            p + "mlp.up_proj.weight": (INTER, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTER),
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
        }
    shapes |= {"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}
    groups, size = [[]], 0
    for name, shape in shapes.items():
        nbytes = 2 * shape[0] * (shape[1] if len(shape) > 1 else 1)
        if groups[-1] and size + nbytes > shard_mb * 1e6:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for k, names in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: (torch.randn(shapes[n], generator=gen) * 0.02).half() for n in names}
        save_file(tensors, folder / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, file)
    total = sum(2 * s[0] * (s[1] if len(s) > 1 else 1) for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    Tokenizer(WordLevel({"a": 0}, unk_token="a")).save(str(folder / "tokenizer.json"))
    return layers


def task(name: str, src: Path, out: Path) -> None:
    """The measured work, in its own process."""
    import kvcalib

    if name == "copy":
        from safetensors.torch import load_file, save_file

        out.mkdir()
        for f in sorted(src.iterdir()):
            if f.suffix == ".safetensors":
                save_file(load_file(f), out / f.name, metadata={"format": "pt"})
            else:
                shutil.copyfile(f, out / f.name)
    elif name in ("convert", "+resid"):
        kvcalib.convert(src, recipe="quarot-kv4", output=out, rotate_residual=name == "+resid")


def measure(name: str, src: Path, out: Path) -> dict:
    """Run `task` in a child of a fresh wrapper, so RUSAGE_CHILDREN sees that child alone."""
    code = (
        "import json, resource, subprocess, sys, time\n"
        "t = time.perf_counter()\n"
        "subprocess.run(sys.argv[1:], check=True)\n"
        "wall = time.perf_counter() - t\n"
        "rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024\n"
        "print(json.dumps({'wall': wall, 'rss': rss}))\n"
    )
    cmd = [sys.executable, "-c", code, sys.executable, __file__, "--task", name, str(src), str(out)]
    result = subprocess.run(cmd, check=True, capture_output=True, text=True)
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--shard-mb", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--residual", action="store_true", help="also time --rotate-residual")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--task", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.task:
        return task(args.task[0], Path(args.task[1]), Path(args.task[2]))
    work = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=args.workdir))
    try:
        src = work / "source"
        t = time.perf_counter()
        layers = build(src, args.size_gb, args.shard_mb)
        files = list(src.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        print(
            f"built {size / 1e9:.2f} GB, {layers} layers, {len(files)} fp16 shards "
            f"in {time.perf_counter() - t:.0f}s"
        )
        for f in src.iterdir():  # warm the page cache once for every task alike
            f.read_bytes()
        names = ["import", "copy", "convert"] + (["+resid"] if args.residual else [])
        runs = {n: [measure(n, src, work / n) for _ in range(args.repeats)] for n in names}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    layer_mib = 2 * _layer_params() / 2**20
    floor = max(r["rss"] for r in runs["import"]) / 2**20
    copy = min(r["wall"] for r in runs["copy"])
    print(
        f"\n{os.cpu_count()} CPUs; one layer = {layer_mib:.0f} MiB fp16; "
        f"best of {args.repeats} wall, largest peak RSS\n"
    )
    print(f"{'task':<10}{'wall s':>9}{'vs copy':>9}{'peak RSS MiB':>14}{'over import':>13}")
    for n in names:
        wall = min(r["wall"] for r in runs[n])
        rss = max(r["rss"] for r in runs[n]) / 2**20
        ratio = f"{wall / copy:.2f}x" if n != "import" else ""
        over = f"{rss - floor:+.0f}" if n != "import" else ""
        print(f"{n:<10}{wall:>9.2f}{ratio:>9}{rss:>14.0f}{over:>13}")
    print(
        f"\ntargets: convert <= 1.5x copy; RSS over import <= one layer + 1 GiB "
        f"= {layer_mib + 1024:.0f} MiB"
    )


if __name__ == "__main__":
    main()
