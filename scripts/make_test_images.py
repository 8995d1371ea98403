"""Writes the small images the tests and demo data send with image requests: tests/fixtures/images/*.png.

Made here from fixed seeds (nothing is downloaded); rerun only to change them:

    python scripts/make_test_images.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

IMAGES_DIR = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "images"


def main() -> None:
    IMAGES_DIR.mkdir(parents=True, exist_ok=True)
    noise = np.random.default_rng(7).integers(0, 256, (56, 70, 3), dtype=np.uint8)  # 4x6 Kimi patches
    Image.fromarray(noise).save(IMAGES_DIR / "noise-56x70.png", optimize=True)
    y, x = np.mgrid[0:84, 0:56]
    gradient = np.stack([(x * 4) % 256, (y * 3) % 256, ((x + y) * 2) % 256], axis=-1).astype(np.uint8)
    Image.fromarray(gradient).save(IMAGES_DIR / "gradient-84x56.png", optimize=True)
    for path in sorted(IMAGES_DIR.glob("*.png")):
        print(f"wrote {path.stat().st_size} bytes to {path.relative_to(IMAGES_DIR.parents[2])}")


if __name__ == "__main__":
    main()
