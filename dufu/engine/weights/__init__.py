"""Weights in and out: sharded checkpoints (DCP, committed atomically, verified), their safe reading, pretrained
weights from a dufu run or a Hugging Face directory, and export to Hugging Face or plain torch files."""
