"""Swin Transformer: the hierarchical vision transformer with shifted windows, for image classification."""

from dufu.models.swin.model import SwinForImageClassification, count_swin_parameters

__all__ = ["SwinForImageClassification", "count_swin_parameters"]
