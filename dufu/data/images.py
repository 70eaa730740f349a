"""Image classification data that needs no download: scikit-learn's handwritten digits.

``load_digits`` ships inside scikit-learn (1,797 grayscale 8 x 8 images of the digits 0-9, values 0-16,
from the UCI "Optical Recognition of Handwritten Digits" set), so tests and recipes run offline.

::

    train_ds, valid_ds = build_digits_datasets(image_size=32, num_channels=1, valid_fraction=0.2)
    train_ds[0]   # {"pixel_values": float32 (1, 32, 32), "labels": int64}

Images are scaled to [0, 1], resized (bilinear) to ``image_size``, repeated to ``num_channels`` channels
and normalised with ``(x - mean) / std``. The train/validation split is a seeded permutation, the same
on every run and every rank.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from dufu.errors import DataError



class ImageClassificationDataset:
    """``dataset[i]`` -> ``{"pixel_values": float32 (C, H, W), "labels": int64}``, images held in memory.

    ``seq_length`` is what the trainer counts per sample for throughput: one image (tokens/s read as images/s)."""

    seq_length = 1

    def __init__(self, pixel_values: np.ndarray, labels: np.ndarray, num_classes: int):
        if len(pixel_values) != len(labels):
            raise DataError(f"{len(pixel_values)} images but {len(labels)} labels")
        self.pixel_values = np.ascontiguousarray(pixel_values, dtype=np.float32)  # (N, C, H, W)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.num_classes = num_classes

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        i = int(i)
        return {"pixel_values": self.pixel_values[i], "labels": self.labels[i]}

    def __repr__(self) -> str:
        return (f"ImageClassificationDataset({len(self)} images of shape {tuple(self.pixel_values.shape[1:])}, "
                f"{self.num_classes} classes)")


def prepare_images(images: np.ndarray, image_size: int, num_channels: int, scale: float,
                   mean: float | Sequence[float], std: float | Sequence[float]) -> np.ndarray:
    """(N, h, w) raw values -> (N, C, S, S) float32: /scale, bilinear resize to S, repeat to C channels, normalise."""
    x = torch.as_tensor(np.asarray(images, dtype=np.float32) / scale)[:, None]  # (N, 1, h, w) in [0, 1]
    if tuple(x.shape[-2:]) != (image_size, image_size):
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    x = x.expand(-1, num_channels, -1, -1)  # (N, C, S, S)
    mean_t = torch.as_tensor(mean, dtype=torch.float32).reshape(-1, 1, 1)
    std_t = torch.as_tensor(std, dtype=torch.float32).reshape(-1, 1, 1)
    return ((x - mean_t) / std_t).numpy()


def build_digits_datasets(
    image_size: int = 32,
    num_channels: int = 1,
    valid_fraction: float = 0.2,
    seed: int = 0,
    mean: float | Sequence[float] = 0.5,
    std: float | Sequence[float] = 0.5,
    tokenizer=None,
) -> tuple[ImageClassificationDataset, ImageClassificationDataset | None]:
    """Train and validation sets of scikit-learn's digits (10 classes).

    ``valid_fraction`` of the 1,797 images (a permutation seeded by ``seed``) are validation; 0 gives
    ``(train, None)``. ``tokenizer`` is accepted and ignored (the trainer passes one to every data builder)."""
    try:
        from sklearn.datasets import load_digits  # scikit-learn takes seconds to import; only the digits data need it
    except ModuleNotFoundError:
        raise DataError("the digits data set ships with scikit-learn, which is not installed: "
                        "pip install scikit-learn (or pip install -e '.[test]').") from None
    if not 0 <= valid_fraction < 1:
        raise DataError(f"valid_fraction must be in [0, 1), got {valid_fraction}.")
    digits = load_digits()
    pixels = prepare_images(digits.images, image_size, num_channels, scale=16.0, mean=mean, std=std)
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    n_valid = int(round(len(labels) * valid_fraction))
    train_idx, valid_idx = np.sort(order[n_valid:]), np.sort(order[:n_valid])
    train = ImageClassificationDataset(pixels[train_idx], labels[train_idx], num_classes=10)
    valid = ImageClassificationDataset(pixels[valid_idx], labels[valid_idx], num_classes=10) if n_valid else None
    return train, valid
