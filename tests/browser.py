"""Rendering a self-contained HTML page in headless Chromium and checking what it drew.

The reports are single files meant to open offline in any browser; a test that only parses the
HTML cannot tell whether the charts are drawn. These helpers take a real screenshot and count the
pixels of a chart's colour, so a page whose SVG fails to render (or renders blank) fails the test.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests import launcher

CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed")


def screenshot(page: Path, out: Path, *, width: int = 1200, height: int = 2600) -> np.ndarray:
    """The page as Chromium renders it offline: an RGB array of ``height`` x ``width`` pixels."""
    assert CHROMIUM is not None
    launcher.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--screenshot={out}",
            f"--window-size={width},{height}",
            page.as_uri(),
        ],
        capture_output=True,
        timeout=90,
        check=True,
    )
    with Image.open(out) as image:
        return np.asarray(image.convert("RGB"))


def pixels_of(image: np.ndarray, color: str, *, tolerance: int = 12) -> int:
    """How many pixels are within ``tolerance`` (per channel) of ``color`` (``#rrggbb``)."""
    target = np.array([int(color[i : i + 2], 16) for i in (1, 3, 5)], dtype=np.int16)
    close = np.abs(image.astype(np.int16) - target) <= tolerance
    return int(close.all(axis=2).sum())
