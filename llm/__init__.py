"""GPT training with the goldfish loss on a 4D (data x depth x row x col) grid.

Maths (no communication): ``config`` (GPTConfig, the presets and every run config), ``model``
(the GPT), ``goldfish`` (which targets the goldfish loss drops), ``neftune`` (NEFTune's
embedding noise, the same on every grid), ``rouge`` (ROUGE-L), ``precision`` (bf16 names and
the saved-activation meter).

Sub-packages: ``parallel/`` (``gpt``: ``ParallelGPT`` and its layout table; ``layers``: the 3D
tensor-parallel Linear, embedding and RMSNorm with the OAR / ORS / OAG overlaps;
``keyed_init``: any block of a parameter, the same values on every grid), ``data/``
(``batches``, ``streams``, ``tokenizers``, ``heldout``), ``hf/`` (``llama``: Hugging Face
Llama names, configs and slices), ``decode/`` (the KV cache and the decode-time methods:
top-k, Loki, SiftAttention, QuantSpec).

Training: ``loss`` (vocabulary-sharded cross-entropy), ``trainer`` (``Trainer``: set-up,
resume, step, evaluation, checkpoints; the loop ``run``), ``checkpoint`` (sharded files).
Command lines: ``python -m llm.train|sample|evaluate|memorization|convert|tokenize|plan``.
"""
