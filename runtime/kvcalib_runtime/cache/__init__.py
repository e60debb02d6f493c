"""The KV caches: the per-layer scheme and its decode rule (`scheme`), the quantized cache
(`kvcache`, one `kvstream.Stream` per layer and tensor) and the full-precision one (`fpcache`)."""
