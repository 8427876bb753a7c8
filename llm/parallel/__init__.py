"""Tensor parallelism of the GPT on the 4D grid ``data x depth x row x col`` (AxoNN-style).

``gpt`` (:class:`~llm.parallel.gpt.ParallelGPT`: the sharded model, gradient sync and
clipping, full tensors in and out), ``layout`` (the layout table and ``param_specs``, the batch
split), ``shards`` (this rank's shards: sliced, drawn from the keyed initialisation, located,
gathered back), ``layers`` (the 3D tensor-parallel Linear, embedding and RMSNorm with the OAR /
ORS / OAG overlaps), ``keyed_init`` (any block of a parameter, the same values on every grid).
Design: docs/design/llm-4d-goldfish.md.
"""
