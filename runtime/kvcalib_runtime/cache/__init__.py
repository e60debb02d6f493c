"""The KV caches: the per-layer scheme and its decode rule (`scheme`), the quantized cache
(`kvcache`, one `kvstream.Stream` per layer and tensor), the full-precision one (`fpcache`), and
a tensor-parallel rank's share of the calibrated tensors (`shard`)."""
