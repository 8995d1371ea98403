"""The tiny Kimi-K2.5's image processor: the interface SGLang's `kimi_k25` processor reads from Kimi's own.

Shipped as remote code in the tiny target's folder (`--trust-remote-code`), because Kimi-K2.5's processor is
remote code of its checkpoint and nothing may be downloaded here. SGLang reads `media_processor.media_proc_cfg`
(patch size, merge kernel, patch limits, mean and std) and `media_tokens_calculator`, and on CPU calls the
processor with `medias=[{"type": "image", "image": PIL image}]`.

Per image (NaViT, as Kimi's processor and SGLang's own GPU path compute it): scale down so the patches fit
`in_patch_limit` and `patch_limit_on_one_side` (never up), bicubic resize, pad right and bottom with zeros to a
multiple of `merge_kernel_size * patch_size`, scale to [0, 1], normalise with mean/std, and cut into patches
row by row. Shapes: pixel_values (N, 3, P, P) over all images' patches, grid_thws (images, 3) = (1, h, w)
in patches; an image's features are h * w / merge_kernel_size^2.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature


class KimiK25VisionProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(self, media_proc_cfg: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        self.media_proc_cfg = dict(media_proc_cfg or {})

    def resize_config(self, width: int, height: int) -> dict:
        cfg = self.media_proc_cfg
        patch, merge = cfg["patch_size"], cfg["merge_kernel_size"]
        limit, side = cfg["in_patch_limit"], cfg["patch_limit_on_one_side"]
        scale = min(1.0, math.sqrt(limit / (max(1.0, width // patch) * max(1.0, height // patch))),
                    side * patch / width, side * patch / height)
        new_w = min(max(1, int(width * scale)), side * patch)
        new_h = min(max(1, int(height * scale)), side * patch)
        factor = merge * patch
        pad_w, pad_h = (factor - new_w % factor) % factor, (factor - new_h % factor) % factor
        return {"new_width": new_w, "new_height": new_h, "pad_width": pad_w, "pad_height": pad_h,
                "num_tokens": ((new_h + pad_h) // factor) * ((new_w + pad_w) // factor)}

    def media_tokens_calculator(self, media: dict) -> int:
        if media.get("type") != "image":
            raise ValueError(f"the tiny Kimi-K2.5 processor takes images only, not {media.get('type')!r}")
        width, height = media["image"].size
        return self.resize_config(width, height)["num_tokens"]

    def patchify(self, image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        from PIL import Image

        cfg = self.media_proc_cfg
        patch = cfg["patch_size"]
        size = self.resize_config(*image.size)
        image = image.convert("RGB")
        if (size["new_width"], size["new_height"]) != image.size:
            image = image.resize((size["new_width"], size["new_height"]), Image.Resampling.BICUBIC)
        pixels = np.asarray(image, dtype=np.float32) / 255.0  # (H, W, 3)
        pixels = (pixels - np.asarray(cfg["image_mean"], np.float32)) / np.asarray(cfg["image_std"], np.float32)
        pixels = np.pad(pixels, ((0, size["pad_height"]), (0, size["pad_width"]), (0, 0)))
        grid_h, grid_w = pixels.shape[0] // patch, pixels.shape[1] // patch
        patches = pixels.reshape(grid_h, patch, grid_w, patch, 3).transpose(0, 2, 4, 1, 3)  # (h, w, 3, P, P)
        return torch.from_numpy(np.ascontiguousarray(patches.reshape(-1, 3, patch, patch))), (1, grid_h, grid_w)

    def preprocess(self, medias: list[dict], return_tensors=None, **kwargs) -> BatchFeature:
        pieces = [self.patchify(media["image"]) for media in medias]
        return BatchFeature({"pixel_values": torch.cat([p for p, _ in pieces]),
                             "grid_thws": torch.tensor([g for _, g in pieces], dtype=torch.int64)})
