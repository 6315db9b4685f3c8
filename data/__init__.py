"""Data: document sources, the BPE tokenizer, token caches and batch loaders."""
