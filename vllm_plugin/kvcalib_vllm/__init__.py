"""kvcalib's vLLM plugin: serve a converted checkpoint's KV side-car in vLLM's paged cache."""
