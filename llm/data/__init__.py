"""Text for the GPT trainer: tokenizers, corpora, resumable batches, held-out text.

``batches`` (byte tokenizer, offline corpus, resumable batch iterator), ``streams`` (corpora
larger than memory: memory-mapped token files), ``tokenizers`` (UTF-8 bytes or a Hugging Face
``tokenizer.json``), ``heldout`` (the held-out split and prompts an evaluation reads).
"""
