"""Hugging Face Llama checkpoints: ``llama`` maps names, configs and slices between HF's
``LlamaForCausalLM`` and :class:`llm.model.GPT` (``python -m llm.convert`` streams them)."""
