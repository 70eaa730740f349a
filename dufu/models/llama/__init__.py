from dufu.models.llama.model import LlamaBlock, LlamaModel

__all__ = ["LlamaBlock", "LlamaModel"]
