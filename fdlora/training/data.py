"""Training data for `fdlora train`: synthetic batches, an image folder, or a `datasets` dataset.

Every source is indexed by (step, rank): batch `step` of the whole run is a fixed set of examples (an epoch-seeded
permutation), split evenly over the processes. So a resumed run sees exactly the batches an uninterrupted one
would, whatever the number of processes, and N processes see the one-process global batch.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fdlora.fixtures import tiny_tasks as tiny

from ..errors import ConfigError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


class Source:
    """Examples by global index; `batch(step, size, rank, world)` is this process's part of global batch `step`."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed

    def indices(self, step: int, size: int) -> list[int]:
        out, pos = [], step * size
        while len(out) < size:
            epoch, i = divmod(pos, self.n)
            perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 7919 + epoch))
            take = min(size - len(out), self.n - i)
            out += perm[i:i + take].tolist()
            pos += take
        return out

    def batch(self, step: int, size: int, rank: int = 0, world: int = 1) -> dict:
        idx = self.indices(step, size)
        per = size // world
        return self.collate(idx[rank * per:(rank + 1) * per])

    def collate(self, idx: list[int]) -> dict:
        raise NotImplementedError


class Synthetic(Source):
    """The task's learnable synthetic examples (fdlora.fixtures.tiny_tasks.synthetic_batch), one per index."""

    def __init__(self, task: str, model, seed: int):
        super().__init__(1 << 30, seed)
        self.task, self.model = task, model

    def batch(self, step: int, size: int, rank: int = 0, world: int = 1) -> dict:
        full = tiny.synthetic_batch(self.task, self.model, size, step, self.seed)
        per = size // world
        return {k: v[rank * per:(rank + 1) * per] for k, v in full.items()}


class ImageFolder(Source):
    """root/<class>/<image>: classes sorted by name, images resized to the model's size, scaled to [-1, 1]."""

    def __init__(self, root: Path, image_size: int, seed: int):
        self.classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.items = [(f, c) for c, name in enumerate(self.classes) for f in sorted((root / name).iterdir())
                      if f.suffix.lower() in IMAGE_SUFFIXES]
        if not self.items:
            raise ConfigError(f"data.source: {root} has no images in class subfolders; allowed: root/<class>/*.png "
                              "(or .jpg/.jpeg/.bmp/.webp); fix: put each class's images in its own folder")
        super().__init__(len(self.items), seed)
        self.size = image_size

    def collate(self, idx: list[int]) -> dict:
        from PIL import Image

        xs, ys = [], []
        for i in idx:
            f, c = self.items[i]
            im = Image.open(f).convert("RGB").resize((self.size, self.size))
            xs.append(torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).view(self.size, self.size, 3))
            ys.append(c)
        x = torch.stack(xs).permute(0, 3, 1, 2).float() / 127.5 - 1
        return {"pixel_values": x, "labels": torch.tensor(ys)}


class HFDataset(Source):
    """A `datasets` dataset (name or saved dir): image + label columns (classification) or a text column (LM)."""

    def __init__(self, name: str, task: str, opts: dict, image_size: int, seed: int):
        import datasets

        path = Path(name)
        ds = datasets.load_from_disk(name) if path.is_dir() and (path / "dataset_info.json").exists() or (
            path / "state.json").exists() else datasets.load_dataset(name, split=opts.get("split", "train"))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[opts.get("split", "train")]
        self.ds, self.task, self.opts, self.size = ds, task, opts, image_size
        super().__init__(len(ds), seed)

    def collate(self, idx: list[int]) -> dict:
        rows = self.ds[idx] if idx else {}
        if self.task == "image-classification":
            ims = [im.convert("RGB").resize((self.size, self.size)) for im in rows[self.opts.get("image_column",
                                                                                                    "image")]]
            x = torch.stack([torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
                             .view(self.size, self.size, 3) for im in ims]).permute(0, 3, 1, 2).float() / 127.5 - 1
            return {"pixel_values": x, "labels": torch.tensor(rows[self.opts.get("label_column", "label")])}
        texts = rows[self.opts.get("text_column", "text")]
        ids = [[b % tiny.VOCAB for b in t.encode()[:64]] for t in texts]  # byte-level ids: no tokenizer download
        L = max(map(len, ids))
        t = torch.tensor([i + [0] * (L - len(i)) for i in ids])
        labels = t.clone()
        labels[t == 0] = -100
        return {"input_ids": t, "labels": labels}


def source_for(cfg, model) -> Source:
    if cfg.data == "synthetic":
        return Synthetic(cfg.task, model, cfg.seed)
    size = cfg.data_options.get("image_size") or getattr(getattr(model, "config", None), "image_size", 224)
    path = Path(cfg.data)
    if path.is_dir() and any(p.is_dir() for p in path.iterdir()) and cfg.task == "image-classification" and not (
            path / "dataset_info.json").exists():
        return ImageFolder(path, size, cfg.seed)
    if cfg.task == "text-to-image":
        raise ConfigError(f"data.source: {cfg.data!r}: text-to-image trains on `synthetic` data here; "
                          "fix: set `data: synthetic`")
    return HFDataset(cfg.data, cfg.task, cfg.data_options, size, cfg.seed)
