"""The KV cache of decoding (:meth:`llm.model.GPT.generate`): keys and values per layer.

A decode step runs only the newest token: its query attends to the keys and values of every
earlier position, kept here instead of recomputed. Keys are stored after the rotary rotation
(a position's rotation never changes while the window does not slide) and for the Hkv
key/value heads only, before grouped-query attention expands them to the H query heads, so
the cache holds ``2 * num_layers * B * Hkv * max_len * Dh`` numbers.

A cache may carry a decode-time attention ``method`` (:class:`DecodeAttention`, e.g. the sparse
methods of :mod:`llm.decode.sparse_attention`): single-token decode steps then call it instead of
full attention, with the query and the cached keys and values of every position.

Shapes legend: B batch, H query heads, Hkv key/value heads, Dh head_dim, T new positions,
S cached positions (including the new one).
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

__all__ = ["DecodeAttention", "KVCache", "LayerCache"]


class DecodeAttention(Protocol):
    """Attention of one new token against the cache, replacing full attention in decode steps.

    Called as ``method(layer, q, k, v)`` for the layer with that index; ``k`` and ``v`` hold the
    Hkv key/value heads (before grouped-query expansion: query head j reads kv head
    ``j // (H // Hkv)``), keys after RoPE.

    Shapes:
        q: [B, H, 1, Dh], k, v: [B, Hkv, S, Dh] -> returns [B, H, 1, Dh]
    """

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class LayerCache:
    """One layer's cached keys (after RoPE) and values, for the Hkv key/value heads.

    Buffers of ``max_len`` positions are allocated at the first :meth:`update`, in the dtype
    and on the device of the keys; ``length`` positions are filled.

    Shapes:
        keys, values: [B, Hkv, max_len, Dh]
    """

    def __init__(self, max_len: int, index: int = 0, method: DecodeAttention | None = None
                 ) -> None:
        self.max_len, self.length, self.index, self.method = max_len, 0, index, method
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the keys and values of the next positions; return those of all positions.

        Shapes:
            k, v: [B, Hkv, T, Dh] -> two [B, Hkv, length + T, Dh] (views of the buffers)
        """
        if self.keys is None or self.values is None:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self.keys, self.values = k.new_empty(shape), v.new_empty(shape)
        end = self.length + k.shape[2]
        assert end <= self.max_len, "GPT.forward checks max_seq_len first"
        self.keys[:, :, self.length : end] = k
        self.values[:, :, self.length : end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on (speculative decoding's rejected drafts)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length


class KVCache:
    """Keys and values of every layer for the positions run so far (one sequence batch).

    Pass it to :meth:`llm.model.GPT.forward`: the tokens given are then positions ``length ..
    length + T - 1`` (RoPE rotates them there) and attend to every cached position.
    """

    def __init__(self, num_layers: int, max_len: int, method: DecodeAttention | None = None
                 ) -> None:
        self.layers = [LayerCache(max_len, i, method) for i in range(num_layers)]
        self.method = method

    @property
    def length(self) -> int:
        """Positions cached (the position of the next token)."""
        return self.layers[0].length

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on, in every layer."""
        for layer in self.layers:
            layer.truncate(length)
