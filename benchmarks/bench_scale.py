"""Scale past one machine's memory: sequential calibration and conversion of a 2B-parameter model.

    python benchmarks/bench_scale.py                          # 2.0B params, bf16, ~4 GB
    python benchmarks/bench_scale.py --phases stats,codebooks --offload
    python benchmarks/bench_scale.py --layers 16 --residual   # ~0.9B params, + R1 rotation
    python benchmarks/bench_scale.py --tasks copy,convert*     # the conversion ratio alone

Builds a random Llama checkpoint (hidden 2048, GQA 16/4 heads, head_dim 128, intermediate 5632,
vocab 49152, 40 layers, untied: 2.005B parameters) in bf16 safetensors shards of --shard-mb,
generated one shard at a time (the builder never holds more than one shard), with the default
model's tokenizer (SmolLM2's, vocab 49152) copied in so that calibration tokenizes real text.
Then each task runs in a fresh subprocess whose peak RSS a wrapper reads with
getrusage(RUSAGE_CHILDREN):

  import     python + torch + kvcalib imported, nothing else (the floor of every row)
  copy       safetensors load_file + save_file of every shard (what any rewrite pays)
  convert    kvcalib.convert with quarot-kv4 (value Hadamard fused into v_proj / o_proj), with
             an empty kvcalib cache: it also hashes the source (its fingerprint)
  convert*   the same with the source's hash cached, as after `kvcalib calibrate` of it
  +resid     with --residual: convert* with --rotate-residual (every weight gets a Hadamard)
  calibrate  kvcalib.calibrate --sequential, --windows x --tokens, --phases, float32, empty cache

The page cache is warmed once; before every run the dirty pages are flushed (os.sync, not
timed), and the tasks run in rounds, interleaved, so that load from other jobs on the machine
falls on all alike; the best wall time and the largest peak RSS of --repeats rounds are
reported, with the load average before each run. Targets on a 2-core, 23 GiB machine: convert
<= 1.5x copy's time and <= 2.5 GiB peak RSS; sequential calibration of 2 windows x 256 tokens
(stats) <= 3 GiB peak RSS. The checkpoint is deleted at the end.
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

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 2048, 16, 4, 128, 5632, 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TASKS = ("import", "copy", "convert", "convert*", "calibrate")


def shapes(layers: int) -> dict[str, tuple[int, ...]]:
    out = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "mlp.gate_proj.weight": (INTER, HIDDEN),
            p + "mlp.up_proj.weight": (INTER, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTER),
        }
    return out | {"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def build(folder: Path, layers: int, shard_mb: int) -> int:
    """Write the random bf16 checkpoint shard by shard; returns its parameter count."""
    import torch
    from safetensors.torch import save_file

    table = shapes(layers)
    groups, size = [[]], 0
    for name, shape in table.items():
        nbytes = 2 * _numel(shape)
        if groups[-1] and size + nbytes > shard_mb * 2**20:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for k, names in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for n in names:
            t = torch.empty(table[n], dtype=torch.bfloat16)
            tensors[n] = (
                t.fill_(1.0) if n.endswith("norm.weight") else t.normal_(0, 0.02, generator=gen)
            )
        save_file(tensors, folder / file, metadata={"format": "pt"})
        del tensors
        weight_map |= dict.fromkeys(names, file)
    total = sum(2 * _numel(s) for s in table.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "num_hidden_layers": layers, "vocab_size": VOCAB,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    _tokenizer(folder)
    return sum(_numel(s) for s in table.values())


def _tokenizer(folder: Path) -> None:
    """SmolLM2's tokenizer from the default model's folder; else one token per byte."""
    try:
        from kvcalib.core.models import resolve

        source = resolve(None).path
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, folder / name)
        return
    except Exception as e:  # any failure: fall back to the byte tokenizer
        print(f"default model's tokenizer unavailable ({e}); using one token per byte")
    from tokenizers import Regex, Tokenizer, decoders
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Split

    tok = Tokenizer(WordLevel({chr(i): i for i in range(256)}, unk_token="?"))
    tok.pre_tokenizer = Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(folder / "tokenizer.json"))


def task(name: str, src: Path, out: Path, opts: dict) -> None:
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
    elif name in ("convert", "convert*", "+resid"):
        kvcalib.convert(src, recipe="quarot-kv4", output=out, rotate_residual=name == "+resid")
    elif name == "calibrate":
        kvcalib.calibrate(
            src,
            out,
            num_samples=opts["windows"],
            seq_len=opts["tokens"],
            phases=tuple(opts["phases"].split(",")),
            sequential=True,
            offload_dir=out.with_name(out.name + "-offload") if opts["offload"] else None,
            progress=False,
        )


def measure(name: str, src: Path, out: Path, opts: dict, cache: Path | None = None) -> dict:
    """Run `task` in a child of a fresh wrapper, so RUSAGE_CHILDREN sees that child alone;
    with kvcalib's cache in `cache`, else in an empty folder."""
    code = (
        "import json, resource, subprocess, sys, time\n"
        "t = time.perf_counter()\n"
        "subprocess.run(sys.argv[1:], check=True)\n"
        "wall = time.perf_counter() - t\n"
        "rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024\n"
        "print(json.dumps({'wall': wall, 'rss': rss}))\n"
    )
    fresh = cache is None
    cache = Path(tempfile.mkdtemp(prefix="kvcalib-cache-", dir=out.parent)) if fresh else cache
    env = {**os.environ, "KVCALIB_CACHE_DIR": str(cache)}
    os.sync()
    args = [sys.executable, __file__, "--task", name, str(src), str(out), json.dumps(opts)]
    cmd = [sys.executable, "-c", code, *args]
    result = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out.with_name(out.name + "-offload"), ignore_errors=True)
    if fresh:
        shutil.rmtree(cache, ignore_errors=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def run(names: list[str], opts: dict, *, layers: int, shard_mb: int, repeats: int, workdir):
    """Build the checkpoint, run `names` in interleaved rounds, delete it; returns
    {name: [{"wall", "rss", "load"}, ...]} (load: the 1-minute load average before the run)."""
    work = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=workdir))
    try:
        src = work / "source"
        t = time.perf_counter()
        params = build(src, layers, shard_mb)
        files = sorted(src.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        print(
            f"built {params / 1e9:.3f}B params, {size / 2**30:.2f} GiB bf16 in {len(files)} "
            f"shards, {layers} layers, in {time.perf_counter() - t:.0f}s",
            flush=True,
        )
        for f in src.iterdir():  # warm the page cache once for every task alike
            f.read_bytes()
        primed = work / "primed-cache"  # the source's sha256 computed once, untimed
        env = {**os.environ, "KVCALIB_CACHE_DIR": str(primed)}
        code = f"from kvcalib.core.models import resolve; resolve({str(src)!r})"
        subprocess.run([sys.executable, "-c", code], check=True, env=env)
        runs = {n: [] for n in names}
        for r in range(repeats):
            for n in names:
                cache = primed if n in ("convert*", "+resid") else None
                load = os.getloadavg()[0]
                runs[n].append({**measure(n, src, work / "out", opts, cache), "load": load})
                one = runs[n][-1]
                print(
                    f"  round {r + 1} {n}: {one['wall']:.1f}s, {one['rss'] / 2**30:.2f} GiB, "
                    f"load {load:.1f}",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--shard-mb", type=int, default=1024)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--phases", default="stats", help="calibration phases, comma-separated")
    parser.add_argument("--offload", action="store_true", help="calibrate with --offload-dir")
    parser.add_argument("--residual", action="store_true", help="also time --rotate-residual")
    parser.add_argument("--tasks", default=",".join(TASKS), help="tasks to run, comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--task", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.task:
        return task(args.task[0], Path(args.task[1]), Path(args.task[2]), json.loads(args.task[3]))
    opts = {k: getattr(args, k) for k in ("windows", "tokens", "phases", "offload")}
    names = args.tasks.split(",") + (["+resid"] if args.residual else [])
    runs = run(
        names,
        opts,
        layers=args.layers,
        shard_mb=args.shard_mb,
        repeats=args.repeats,
        workdir=args.workdir,
    )
    copy = min(r["wall"] for r in runs["copy"]) if "copy" in runs else None
    print(
        f"\n{os.cpu_count()} CPUs; calibrate: {args.windows} windows x {args.tokens} tokens, "
        f"phases {args.phases}{', offloaded' if args.offload else ''}; best of {args.repeats} "
        "wall, largest peak RSS, load average range\n"
    )
    print(f"{'task':<11}{'wall s':>9}{'vs copy':>9}{'peak RSS GiB':>14}{'load':>11}")
    for n in names:
        wall = min(r["wall"] for r in runs[n])
        rss = max(r["rss"] for r in runs[n]) / 2**30
        loads = [r["load"] for r in runs[n]]
        ratio = f"{wall / copy:.2f}x" if copy and n.startswith(("copy", "convert", "+")) else ""
        load = f"{min(loads):.1f}-{max(loads):.1f}"
        print(f"{n:<11}{wall:>9.1f}{ratio:>9}{rss:>14.2f}{load:>11}")
    print("\ntargets: convert <= 1.5x copy and <= 2.5 GiB; calibrate <= 3 GiB")
    print("convert: empty kvcalib cache (hashes the source); convert*: the source's hash cached")


if __name__ == "__main__":
    main()
