"""ViT: the vision transformer for image classification."""

from dufu.models.vit.model import ViTForImageClassification, classification_loss, count_vit_parameters

__all__ = ["ViTForImageClassification", "classification_loss", "count_vit_parameters"]
