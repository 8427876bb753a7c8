"""GPT training with the goldfish loss, built to run on a 4D (data x depth x row x col) grid.

Modules: ``model`` (the GPT maths, no communication), ``goldfish`` (which target tokens the
goldfish loss drops, and the loss itself), ``data`` (byte tokenizer, offline corpus, resumable
batch iterator). Parallelization is applied to the model by a separate function.
"""
