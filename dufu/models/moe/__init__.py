from dufu.models.moe.model import MoEModel

__all__ = ["MoEModel"]
