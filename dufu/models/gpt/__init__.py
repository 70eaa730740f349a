"""GPT-2: the decoder-only language model (learned positions, tied head)."""

from dufu.models.gpt.model import GPTModel, causal_lm_loss

__all__ = ["GPTModel", "causal_lm_loss"]
