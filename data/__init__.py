"""Corpora, tokenizers and batches: data.tokenizer, data.prepare, data.batches."""
