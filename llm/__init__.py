"""GPT training with the goldfish loss on a 4D (data x depth x row x col) grid.

Maths (no communication): ``config`` (GPTConfig and the presets), ``model`` (the GPT),
``goldfish`` (which targets the goldfish loss drops), ``data`` (byte tokenizer, offline corpus,
resumable batches), ``rouge`` (ROUGE-L).

Parallelism: ``tp`` (the 3D tensor-parallel Linear, embedding and RMSNorm, with the OAR / ORS /
OAG overlaps), ``parallel`` (``ParallelGPT``: draws only this rank's shards of a meta-device
GPT from the keyed initialisation of ``init``, gradient sync and clipping, gathering full
tensors back), ``loss`` (vocabulary-sharded cross-entropy).

Training: ``trainer`` (one config dataclass per component, AdamW with warmup + cosine, the
step, evaluation, grid-independent state, and the loop ``run``), ``checkpoint`` (atomic files),
``train`` (the CLI ``python -m llm.train``: arguments, configs, printing), ``plan`` (the
performance model's grid ranking for a preset, ``python -m llm.plan``), ``memorization``
(``python -m llm.memorization``), ``sample`` (``python -m llm.sample``).
"""
