"""Sharded output (`--max-shard-size`) and sharded sources: the shard plan follows Hugging
Face's rule, every shard stays under the limit, and the index, the files on disk and the
manifest agree exactly (tests/toolkit/test_convert.py checks the logits and the tensors)."""

import hashlib
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from tiny import save_with_tokenizer, tiny_model

from kvcalib.cli import main
from kvcalib.errors import ModelError, OptionError
from kvcalib.io.shards import TensorSpec, ahead, parse_size, plan_shards
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
