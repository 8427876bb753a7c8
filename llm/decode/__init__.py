"""Long-context decoding: the KV cache and the decode-time attention methods.

``kv_cache`` (keys and values per layer; full attention), ``sparse_attention`` (exact top-k,
Loki, SiftAttention, with byte accounting), ``loki`` (Loki's PCA bases of the keys),
``quantspec`` (self-speculative decoding with a 4-bit KV cache and weights).
Design: docs/design/llm-inference.md.
"""
