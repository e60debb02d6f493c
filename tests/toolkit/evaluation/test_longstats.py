"""The long-context suite's statistics against values computed by hand or known from the
literature, and the probe's reading of attention and key error."""

import contextlib
import math

import pytest
import torch
from support.tiny import tiny_model

from kvcalib.evaluation import longcontext, longprobe, longstats
from kvcalib.evaluation.score import candidates


def test_wilson_matches_its_closed_form():
    # Newcombe (1998), table I: 81/263 -> [0.2553, 0.3662]; 0/10 -> [0, 0.2775]
    assert longstats.wilson(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    assert longstats.wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert longstats.wilson(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    for n in range(1, 60):  # the bounds hold the accuracy, at 0 and n too (plots need it)
        for k in (0, 1, n // 2, n - 1, n):
            low, high = longstats.wilson(k, n)
            assert low <= k / n <= high or min(abs(low - k / n), abs(high - k / n)) < 1e-12
    low, high = longstats.wilson(25, 50)
    assert low < 0.5 < high and high - low < 0.3  # n = 50 resolves about +-14 points


def test_mcnemar_is_the_exact_binomial_test():
    assert longstats.mcnemar(0, 0) == 1.0
    assert longstats.mcnemar(5, 0) == pytest.approx(2 / 32)  # 2 * 0.5^5
    assert longstats.mcnemar(3, 1) == pytest.approx(2 * 5 / 16)  # 2 * P(X <= 1), X ~ B(4, .5)
    assert longstats.mcnemar(1, 3) == longstats.mcnemar(3, 1)
    assert longstats.mcnemar(10, 10) == 1.0


def test_paired_interval_covers_the_mean_and_shrinks_with_n():
    few = longstats.paired_interval([0, -1, 0, 0, -1])
    many = longstats.paired_interval([0, -1, 0, 0, -1] * 20)
    assert few[0] <= -0.4 <= few[1] and many[0] <= -0.4 <= many[1]
    assert many[1] - many[0] < (few[1] - few[0]) / 2  # 20x the prompts: ~1/4.5 the width
    assert longstats.paired_interval([0.0] * 7) == (0.0, 0.0)
    assert all(math.isnan(x) for x in longstats.paired_interval([]))


def test_probe_reads_the_models_own_attention():
    # The probe's eager attention must be the attention the model computes: the same logits
    # through the same cache with and without it (a probe that changed attention would differ).
    model = tiny_model("llama", num_attention_heads=4, num_key_value_heads=2)
    (c,) = candidates(model, ["per-token-2"])
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(0))
    step = torch.tensor([[7, 9]])
    outs, probes = [], []
    with torch.no_grad():
        prefill = longcontext.Prefill(model, ids, set())
        for probed in (False, True):
            with longcontext.filled_cache(model, c, prefill, 96) as cache:
                probe = longprobe.Probe(model, prefill.keys, [(30, 34)], (5, 75))
                with probe if probed else contextlib.nullcontext():
                    outs.append(model(step, cache=cache).logits)
                probes.append(probe)
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-5)
    record = probes[1].record()
    assert 0 < record["needle_mass"] < 1 and 0 < record["sink_mass"] < 1
    assert record["needle_key_error"] > 0  # 2-bit keys: an error the probe sees
    assert len(record["layers"]["sink_mass"]) == model.config.num_hidden_layers


def test_probe_names_clamped_needles():
    # Keys with 5x the haystack's error at the needle positions read as clamped; the same error
    # everywhere does not.
    torch.manual_seed(0)
    ref = torch.randn(1, 2, 40, 16)
    noise = 0.1 * torch.randn_like(ref)
    for needle_scale, clamped in ((5.0, True), (1.0, False)):
        keys = ref + noise
        keys[:, :, 20:23] = ref[:, :, 20:23] + needle_scale * noise[:, :, 20:23]
        probe = longprobe.Probe(None, [ref], [(20, 23)], (2, 38))
        probs = torch.full((1, 4, 1, 40), 1 / 40)
        probe.observe(0, probs, keys)
        record = probe.record()
        assert record["needle_mass"] == pytest.approx(3 / 40)
        assert (record["needle_key_error"] >= longprobe.CLAMPED) is clamped
        fp = {"sink_mass": 1 / 40, "needle_mass": 3 / 40}
        assert (longprobe.diagnose(record, fp) == "needle keys clamped") is clamped
    # keys stored exactly, up to the float noise of RoPE applied elsewhere: no key error at all
    probe = longprobe.Probe(None, [ref], [(20, 23)], (2, 38))
    probe.observe(0, probs, ref * (1 + 1e-7))
    assert probe.record()["needle_key_error"] is None
    none = longprobe.Probe(None, [ref], [], (2, 38))  # a task without needles (freqwords)
    none.observe(0, probs, keys)
    assert none.record()["needle_mass"] is None and none.record()["layers"]["needle_mass"] == [None]
    lost = {"sink_mass": 0.01, "needle_mass": 0.01, "needle_key_error": 1.0}
    assert longprobe.diagnose(lost, {"sink_mass": 0.5, "needle_mass": 0.2}) == (
        "sink attention lost, needle attention lost"
    )
