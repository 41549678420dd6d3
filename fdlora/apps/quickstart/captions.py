"""Caption rows under the pictures the commands save: which adapters and weights made each tile, and (for a blend
sweep) a colour statistic of the tile, printed and drawn as a bar, so the effect can be read and not only seen.

Used by `fdlora quickstart` (blend_grid.png, per_prompt.png) and `fdlora run` (its one image). Needs pillow only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

CAPTION_BG, CAPTION_FG = (255, 255, 255), (20, 20, 20)


def describe(adapters: Mapping[str, float] | str | None) -> str:
    """{"warm": 0.75, "cool": 0.25} -> "warm 0.75 + cool 0.25"; a name -> "name 1"; None or {} -> "no adapter"."""
    if adapters is None or adapters == {}:
        return "no adapter"
    if isinstance(adapters, str):
        return f"{adapters} 1"
    return " + ".join(f"{name} {weight:g}" for name, weight in adapters.items())


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1: a scalable font
    except TypeError:  # older Pillow: the fixed bitmap font
        return ImageFont.load_default()


def _as_pil(tile):
    """A PIL image, or a [3, H, W] tensor / array in [0, 1]."""
    from PIL import Image

    if isinstance(tile, Image.Image):
        return tile.convert("RGB")
    import numpy as np

    arr = np.asarray(tile.detach().cpu().float() if hasattr(tile, "detach") else tile, dtype=np.float32)
    arr = (np.clip(arr.transpose(1, 2, 0), 0, 1) * 255).round().astype(np.uint8)
    return Image.fromarray(arr)


def mean_rgb(tile) -> tuple[float, float, float]:
    """The tile's mean colour, each channel in [0, 1]."""
    import numpy as np

    arr = np.asarray(_as_pil(tile), dtype=np.float32) / 255.0
    return tuple(float(v) for v in arr.reshape(-1, 3).mean(0))


def captioned_grid(tiles: Sequence, captions: Sequence[Sequence[str]], *, cols: int | None = None,
                   tile_px: int = 160, bars: Sequence[Sequence[tuple[str, float, tuple[int, int, int]]]] | None = None,
                   title: str | None = None):
    """Tiles in a grid, each scaled to `tile_px` (nearest neighbour, so small latents stay crisp), with its caption
    lines under it and, optionally, labelled bars (name, value in [0, 1], colour) drawn under the caption."""
    from PIL import Image, ImageDraw

    tiles = [_as_pil(t) for t in tiles]
    n = len(tiles)
    cols = cols or n
    rows = -(-n // cols)
    font, small = _font(13), _font(11)
    line_h, bar_h, pad = 16, 14, 6
    n_lines = max((len(c) for c in captions), default=0)
    n_bars = max((len(b) for b in bars), default=0) if bars else 0
    cell_w = tile_px + 2 * pad
    cell_h = tile_px + pad + n_lines * line_h + n_bars * (bar_h + 2) + 2 * pad
    head = line_h + pad if title else 0
    canvas = Image.new("RGB", (cols * cell_w, head + rows * cell_h), CAPTION_BG)
    draw = ImageDraw.Draw(canvas)
    if title:
        draw.text((pad, pad // 2), title, fill=CAPTION_FG, font=font)
    for i, tile in enumerate(tiles):
        r, c = divmod(i, cols)
        x, y = c * cell_w + pad, head + r * cell_h + pad
        canvas.paste(tile.resize((tile_px, tile_px), Image.NEAREST), (x, y))
        ty = y + tile_px + pad // 2
        for line in captions[i] if i < len(captions) else ():
            draw.text((x, ty), line, fill=CAPTION_FG, font=font)
            ty += line_h
        for name, value, colour in (bars[i] if bars and i < len(bars) else ()):
            value = min(max(float(value), 0.0), 1.0)
            label_w = 12
            draw.text((x, ty), name, fill=CAPTION_FG, font=small)
            width = tile_px - label_w - 34
            draw.rectangle((x + label_w, ty + 2, x + label_w + width, ty + bar_h - 2), outline=(190, 190, 190))
            draw.rectangle((x + label_w, ty + 2, x + label_w + round(width * value), ty + bar_h - 2), fill=colour)
            draw.text((x + label_w + width + 4, ty), f"{value:.2f}", fill=CAPTION_FG, font=small)
            ty += bar_h + 2
    return canvas


def blend_sweep_grid(tiles: Sequence, weights: Sequence[Mapping[str, float]], *, title: str | None = None):
    """A blend sweep: each tile captioned with its adapters and weights, its mean colour printed and drawn as red,
    green and blue bars, so the shift from one adapter to the other is a number per tile."""
    stats = [mean_rgb(t) for t in tiles]
    captions = [[describe(w), f"mean R {s[0]:.2f}  B {s[2]:.2f}"] for w, s in zip(weights, stats)]
    bars = [[("R", s[0], (215, 60, 40)), ("G", s[1], (60, 160, 70)), ("B", s[2], (40, 90, 215))] for s in stats]
    return captioned_grid(tiles, captions, bars=bars, title=title), stats


def captioned_image(image, adapters: Mapping[str, float] | None, *, prompt: str | None = None,
                    extra: str | None = None, tile_px: int | None = None):
    """One generated image with a caption row: its adapters and weights, the prompt, and an extra line."""
    image = _as_pil(image)
    size = tile_px or max(256, min(image.width, 768))
    lines = [describe(adapters)]
    if prompt:
        lines.append(f'"{prompt}"' if len(prompt) <= 44 else f'"{prompt[:41]}..."')
    if extra:
        lines.append(extra)
    return captioned_grid([image], [lines], tile_px=size)
