"""Inference on a trained model: sampling and beam search with a KV cache, and streaming generation of a model
too large for memory (its weights read layer by layer from disk)."""
