"""Sharded output (`--max-shard-size`) and sharded sources: the shard plan follows Hugging
Face's rule, every shard stays under the limit, and the index, the files on disk and the
manifest agree exactly (tests/toolkit/conversion/test_convert.py checks the logits and the
tensors)."""

import hashlib
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file
from support.tiny import save_with_tokenizer, tiny_model

import kvcalib
from kvcalib.cli import main
from kvcalib.errors import ModelError, OptionError
from kvcalib.io import shards
from kvcalib.io.shards import (
    ShardWriter,
    SourceWeights,
    TensorSpec,
    ahead,
    parse_size,
    plan_shards,
)
from kvcalib_runtime.checkpoint import format


def test_ahead_hands_over_items_in_order_and_the_producers_error():
    # convert reads and transforms on this thread while the main thread writes
    with ahead(iter(range(100)), 3) as items:
        assert list(items) == list(range(100))

    def failing():
        yield 1
        raise ModelError("layer 7 has no tensor v_proj.weight")

    with pytest.raises(ModelError, match="layer 7 has no"), ahead(failing(), 3) as items:
        assert next(items) == 1
        next(items)


def test_ahead_stops_drawing_when_the_consumer_leaves():
    drawn = []

    def producer():
        for i in range(1000):
            drawn.append(i)
            yield i

    with pytest.raises(RuntimeError, match="disk on fire"), ahead(producer(), 2) as items:
        next(items)
        raise RuntimeError("disk on fire")
    assert len(drawn) <= 4  # one taken, at most two queued, one waiting to be: then stopped


def test_plan_fills_each_shard_up_to_the_limit_and_isolates_a_larger_tensor():
    specs = [TensorSpec(f"t{i}", (n,), torch.float32) for i, n in enumerate([10, 10, 30, 5, 5])]
    plan = [[s.name for s in shard] for shard in plan_shards(specs, max_bytes=80)]
    # 40 + 40 bytes fill the first; 120 bytes pass the limit alone: a shard of its own
    assert plan == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    assert [[s.name for s in shard] for shard in plan_shards(specs, 10**6)] == [
        ["t0", "t1", "t2", "t3", "t4"]
    ]


@pytest.mark.parametrize(
    ("text", "size"),
    [("5GB", 5 * 10**9), ("500MiB", 500 * 2**20), ("2GiB", 2 * 2**30), ("20KB", 20_000),
     (" 1.5 kb ", 1500), ("123", 123), (4096, 4096)],
)  # fmt: skip
def test_sizes_read_as_transformers_reads_them(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["0", "-1GB", "5 GBs", "lots", True])
def test_bad_sizes_are_refused(text):
    with pytest.raises(OptionError, match="use a size such as 5GB"):
        parse_size(text)


def test_cli_max_shard_size_from_a_sharded_source(tmp_path):
    limit = 30_000
    model = tiny_model("llama")
    src = tmp_path / "src"
    model.save_pretrained(src, max_shard_size="20KB")  # a sharded source with its own index
    save_with_tokenizer(model, tmp_path / "tok")
    (src / "tokenizer.json").write_bytes((tmp_path / "tok" / "tokenizer.json").read_bytes())
    assert (src / format.INDEX).is_file()
    out = tmp_path / "out"
    args = [
        "convert",
        str(src),
        "--recipe",
        "quarot-kv4",
        "-o",
        str(out),
        "--max-shard-size",
        "30KB",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output

    index = json.loads((out / format.INDEX).read_text())
    shards = sorted(p.name for p in out.glob("model*.safetensors"))
    n = len(shards)
    assert n > 3 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(set(index["weight_map"].values())) == shards  # no shard unlisted or missing
    total, names = 0, set()
    for shard in shards:
        with safe_open(out / shard, "pt") as f:
            sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
        nbytes = sum(4 * torch.Size(s).numel() for s in sizes.values())  # fp32 throughout
        assert nbytes <= limit or len(sizes) == 1, shard  # only a lone tensor may pass the limit
        assert all(index["weight_map"][k] == shard for k in sizes)
        total += nbytes
        names |= set(sizes)
    assert names == set(index["weight_map"]) == set(model.state_dict())
    assert index["metadata"]["total_size"] == total
    files = json.loads((out / format.MANIFEST).read_text())["files"]
    for name in [*shards, format.INDEX]:
        data = (out / name).read_bytes()
        assert files[name] == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    format.read_checkpoint(out)  # the runtime's validator, hashes included


def test_source_tensors_are_mapped_copy_on_write(tmp_path):
    """read() maps the file: the tensors equal what safetensors loads (odd and empty shapes
    too), and writing into one changes neither the file nor a second read."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(97, 3, generator=g).bfloat16(),
        "b": torch.randn(1, generator=g),
        "c": torch.zeros(0, 5, dtype=torch.float16),
        "d": torch.arange(257, dtype=torch.int64),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    before = (tmp_path / "model.safetensors").read_bytes()
    source = SourceWeights(tmp_path)
    read = source.read(sorted(tensors))
    assert all(read[k].dtype == v.dtype and torch.equal(read[k], v) for k, v in tensors.items())
    read["a"].mul_(2)
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert torch.equal(source.read(["a"])["a"], tensors["a"])


@pytest.mark.parametrize("piece", [7, 1 << 22])  # many pieces per tensor, or one
def test_spans_are_copied_byte_for_byte_and_hashed(tmp_path, monkeypatch, piece):
    """A Span is written as the source's bytes, exactly, and hashed as written: the shard is
    byte-identical to one written from the tensors themselves."""
    monkeypatch.setattr(shards, "PIECE", piece)
    g = torch.Generator().manual_seed(1)
    tensors = {"x": torch.randn(1025, generator=g).bfloat16(), "y": torch.randn(3, 97)}
    save_file(tensors, tmp_path / "model.safetensors")
    source = SourceWeights(tmp_path)
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    written = {}
    for way in ("tensors", "spans"):
        out = tmp_path / way
        out.mkdir()
        writer = ShardWriter(out, specs, max_bytes=10**6)
        for s in specs:
            writer.write(s.name, source.span(s.name) if way == "spans" else tensors[s.name])
        writer.close()
        hashes = writer.finish()
        written[way] = (out / shards.shard_name(0, 1)).read_bytes()
        assert hashes[shards.shard_name(0, 1)] == hashlib.sha256(written[way]).hexdigest()
    assert written["spans"] == written["tensors"]


def test_untouched_tensors_are_the_source_bytes(tmp_path):
    """With the value rotation alone, every tensor but v_proj and o_proj passes through: its
    bytes in the output are the source's, bit for bit (bf16: no float round-trip)."""
    model = tiny_model("llama").to(torch.bfloat16)
    src = save_with_tokenizer(model, tmp_path / "src")
    out = kvcalib.convert(src, recipe="quarot-kv4", output=tmp_path / "out")
    source, converted = SourceWeights(src), SourceWeights(out)
    names = sorted(source.entries)
    assert sorted(converted.entries) == names
    before, after = source.read(names), converted.read(names)
    rotated = {n for n in names if n.endswith(("v_proj.weight", "o_proj.weight"))}
    assert rotated and all(not torch.equal(after[n], before[n]) for n in rotated)
    for n in sorted(set(names) - rotated):
        assert torch.equal(after[n].view(torch.uint8), before[n].view(torch.uint8)), n
