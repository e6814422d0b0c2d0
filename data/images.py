"""Image helpers of the readers (PIL + numpy/torch; no torchvision): RGB conversion, cover-resize and centre
crop, and the (3, H, W) float tensor in [-1, 1] the model trains on."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

__all__ = ["IMAGE_EXTENSIONS", "to_rgb", "resize_center_crop", "resize_cover_crop", "image_to_tensor"]

# The member extensions a sample's image may have, in the order a reader looks for them.
IMAGE_EXTENSIONS: tuple[str, ...] = ("jpg", "jpeg", "png", "webp")


def to_rgb(img: Image.Image, background: tuple[int, int, int] = (255, 255, 255)) -> Image.Image:
    """RGB version of `img`; transparent images (RGBA, LA, P with transparency) are composited over white."""
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        base = Image.new("RGBA", rgba.size, background + (255,))
        return Image.alpha_composite(base, rgba).convert("RGB")
    return img.convert("RGB")


def resize_center_crop(img: Image.Image, size: int) -> Image.Image:
    """Resize so the shorter side is `size` (bicubic, antialiased when shrinking), then crop the centre square."""
    return resize_cover_crop(img, size, size)


def resize_cover_crop(img: Image.Image, width: int, height: int) -> Image.Image:
    """Resize (keeping the aspect ratio; bicubic, antialiased when shrinking) to the smallest size that covers
    width x height, then crop the centre width x height. `resize_center_crop` is the square case."""
    w, h = img.size
    if w <= 0 or h <= 0:
        raise ValueError(f"empty image ({w}x{h})")
    if width * h >= height * w:  # the width is the tighter constraint: scale it to `width`
        nw, nh = width, max(height, round(h * width / w))
    else:
        nw, nh = max(width, round(w * height / h)), height
    if (nw, nh) != (w, h):
        img = img.resize((nw, nh), Image.Resampling.BICUBIC)
    left, top = (nw - width) // 2, (nh - height) // 2
    if (nw, nh) != (width, height):
        img = img.crop((left, top, left + width, top + height))
    return img


def image_to_tensor(img: Image.Image) -> torch.Tensor:
    """(3, H, W) float32 tensor in [-1, 1] from a PIL image of any common mode (L, RGBA, P, CMYK, ...)."""
    arr = np.asarray(to_rgb(img), dtype=np.uint8)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).float().div_(127.5).sub_(1.0)
