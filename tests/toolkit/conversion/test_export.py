"""`--export vllm-fp8` as its readers see it: compressed-tensors' own config classes parse the
`quantization_config`, and the scale tensors have exactly the names and shapes compressed-tensors
registers on each attention module for that `kv_cache_scheme` (`model.layers.{i}.self_attn.k_scale`
and `v_scale`, [1]), which vLLM's loader maps onto its attention layers (`...self_attn.attn.
k_scale`, maybe_remap_kv_scale_name in vllm/model_executor/model_loader/weight_utils.py) after
CompressedTensorsKVCacheMethod.validate_kv_cache_scheme accepted the scheme (float, 8 bits,
strategy "tensor", symmetric).
"""

import json

import pytest
import torch
from safetensors import safe_open
from support.tiny import TINY_CONFIGS, save_with_tokenizer, tiny_model

from kvcalib.calibration import calibrate
from kvcalib.conversion.convert import convert

ct = pytest.importorskip("compressed_tensors.quantization", reason="pip install -e '.[test]'")


def test_export_is_what_compressed_tensors_and_vllm_read(tmp_path):
    from compressed_tensors.quantization.lifecycle import initialize_qparams

    src = save_with_tokenizer(tiny_model("llama"), tmp_path / "src")
    profile = tmp_path / "profile"
    calibrate(src, profile, num_samples=2, seq_len=32, phases=("stats",), progress=False)
    out = convert(
        src, recipe="quarot-kv4", output=tmp_path / "out", profile=profile, export="vllm-fp8"
    )
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = ct.QuantizationConfig.model_validate(config)
    assert parsed.quant_method == "compressed-tensors" and parsed.config_groups == {}
    assert parsed.kv_cache_scheme == ct.QuantizationArgs(
        num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True
    )

    # What compressed-tensors' lifecycle registers for this scheme on every attention module
    # (apply_quantization_config itself does not recognize transformers 5's attention forward).
    cfg = TINY_CONFIGS["llama"]
    kv_shape = (cfg["num_key_value_heads"], None, cfg["hidden_size"] // cfg["num_attention_heads"])
    reference = tiny_model("llama")
    for name, module in reference.named_modules():
        if name.endswith(".self_attn"):
            for kind in (ct.KVCacheScaleType.KEY, ct.KVCacheScaleType.VALUE):
                initialize_qparams(
                    module,
                    kind.value.removesuffix("_scale"),
                    parsed.kv_cache_scheme,
                    observed_shape=kv_shape,
                    observed_dtype=torch.float32,
                    force_zero_point=False,
                )
    want = {
        n: (tuple(p.shape), p.dtype)
        for n, p in reference.named_parameters()
        if n.endswith(("k_scale", "v_scale"))
    }
    assert sorted(want) == [f"model.layers.{i}.self_attn.{k}_scale" for i in (0, 1) for k in "kv"]
    got = {}
    for f in sorted(out.glob("model*.safetensors")):
        with safe_open(f, "pt") as st:
            for n in st.keys():  # noqa: SIM118 - safe_open is not a dict
                if n.endswith(("k_scale", "v_scale")):
                    t = st.get_tensor(n)
                    assert torch.isfinite(t).all() and (t > 0).all(), n
                    got[n] = (tuple(t.shape), t.dtype)
    assert got == want
