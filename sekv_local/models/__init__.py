"""Model registry, GGUF loading, tokenizer and the PyTorch transformer."""
