"""CIFAR-10 and CIFAR-100 from the python-pickle files of Krizhevsky's "Learning Multiple Layers of
Features from Tiny Images" (2009), the layout torchvision's ``datasets.CIFAR10/100`` read and write.

    <data_dir>/cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}
    <data_dir>/cifar-100-python/{train, test, meta}

(``data_dir`` may also be the ``cifar-*`` folder itself.) Each data file is a pickled dict with
``data``: uint8 [N, 3072] (the 1024 red, then green, then blue values of a 32x32 image, row-major)
and ``labels`` (CIFAR-10) or ``fine_labels`` (CIFAR-100). The images stay uint8, [N, 3, 32, 32].

Nothing is downloaded unless ``download=True`` (torchvision then fetches and checks the archive;
it is an optional extra: ``pip install "fedopt_kernels[data]"``). The pickles are read with an
unpickler that only builds dicts, lists, strings, numbers and numpy arrays, so a foreign pickle in
the folder cannot run code.
"""

from __future__ import annotations

import functools
import pickle
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .datasets import ArrayDataset
from .folder import data_root, first_existing_dir, require_file

# per-channel mean and std of the training images, in [0, 1] units (the usual normalisation)
CIFAR_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


@functools.cache
def _layout(name: str) -> Dict[str, Any]:
    if name == "cifar10":
        return dict(
            folder="cifar-10-batches-py",
            train=[f"data_batch_{i}" for i in range(1, 6)],
            test=["test_batch"],
            meta="batches.meta",
            label_key="labels",
            names_key="label_names",
            classes=10,
            title="CIFAR-10",
            tv="CIFAR10",
            archive="cifar-10-python.tar.gz",
        )
    if name == "cifar100":
        return dict(
            folder="cifar-100-python",
            train=["train"],
            test=["test"],
            meta="meta",
            label_key="fine_labels",
            names_key="fine_label_names",
            classes=100,
            title="CIFAR-100",
            tv="CIFAR100",
            archive="cifar-100-python.tar.gz",
        )
    raise ValueError(f"unknown CIFAR data set {name!r} (cifar10 or cifar100)")


def how_to_get(name: str, data_dir: Optional[str] = None) -> str:
    lay = _layout(name)
    root = data_dir or "DIR"
    return (
        f"{lay['title']} is expected as {root}/{lay['folder']}/ holding {', '.join(lay['train'] + lay['test'])} and "
        f"{lay['meta']} (the python version of the data set): unpack {lay['archive']} from "
        f"https://www.cs.toronto.edu/~kriz/cifar.html into {root}; or, with torchvision (the [data] extra: "
        f'pip install "fedopt_kernels[data]"), pass --download, or run '
        f"`python -c \"import torchvision; torchvision.datasets.{lay['tv']}('{root}', download=True)\"`."
    )


_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),  # how protocol-2 pickles written by Python 3 store bytes
}


class _SafeUnpickler(pickle.Unpickler):
    """Builds only plain containers and numpy arrays (what the CIFAR files hold)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        if module == "_codecs":
            import codecs

            return codecs.encode
        if module.startswith("numpy") and module.endswith("multiarray"):
            try:  # numpy >= 2 keeps these in numpy._core; older ones in numpy.core
                import numpy._core.multiarray as ma
            except ImportError:  # pragma: no cover - numpy 1.x
                import numpy.core.multiarray as ma  # type: ignore[no-redef]
            return getattr(ma, name)
        return getattr(np, name)


def _unpickle(path: Path, name: str) -> Dict[str, Any]:
    try:
        with open(path, "rb") as f:
            obj = _SafeUnpickler(f, encoding="latin1").load()
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
        UnicodeDecodeError,
        OSError,
    ) as exc:
        raise ValueError(
            f"could not read {str(path)!r} as a {_layout(name)['title']} python pickle "
            f"({type(exc).__name__}: {exc}); the file is damaged or not from the python version. "
            f"{how_to_get(name)}"
        ) from None
    if not isinstance(obj, dict):
        raise ValueError(f"{str(path)!r} holds a {type(obj).__name__}, expected a dict. {how_to_get(name)}")
    # files pickled under Python 2 come back with str keys under latin1; pickles of bytes keys stay bytes
    return {(k.decode("latin1") if isinstance(k, bytes) else k): v for k, v in obj.items()}


def _read_batch(path: Path, name: str) -> Tuple[np.ndarray, np.ndarray]:
    lay = _layout(name)
    d = _unpickle(path, name)
    want = f"a dict with 'data' (uint8, N x 3072) and '{lay['label_key']}' (N integers in 0..{lay['classes'] - 1})"
    if "data" not in d or lay["label_key"] not in d:
        raise ValueError(f"{str(path)!r} has keys {sorted(map(str, d))}, expected {want}. {how_to_get(name)}")
    data, labels = d["data"], d[lay["label_key"]]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        got = f"{data.dtype} array of shape {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise ValueError(f"{str(path)!r}: 'data' is a {got}, expected {want}. {how_to_get(name)}")
    try:
        y = np.asarray(labels, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError):
        raise ValueError(f"{str(path)!r}: '{lay['label_key']}' is not a list of integers; expected {want}.") from None
    if len(y) != len(data):
        raise ValueError(f"{str(path)!r}: {len(data)} images but {len(y)} labels; expected {want}.")
    if len(y) and (y.min() < 0 or y.max() >= lay["classes"]):
        raise ValueError(
            f"{str(path)!r}: labels span {y.min()}..{y.max()}, expected 0..{lay['classes'] - 1} ({lay['title']})."
        )
    return data.reshape(-1, 3, 32, 32), y


def _download(name: str, root: Path) -> None:
    try:
        import torchvision
    except ImportError:
        raise ValueError(
            'download=True (--download) needs torchvision: pip install "fedopt_kernels[data]" '
            "(or put the files there yourself; see docs/data.md)"
        ) from None
    cls = getattr(torchvision.datasets, _layout(name)["tv"])
    for train in (True, False):
        cls(str(root), train=train, download=True)


@functools.lru_cache(maxsize=2)
def _load_cached(name: str, folder: str, stamp: Tuple) -> Tuple[ArrayDataset, ArrayDataset, Tuple[str, ...]]:
    lay = _layout(name)
    base = Path(folder)
    hint = how_to_get(name, str(base.parent))
    meta = _unpickle(require_file(base / lay["meta"], f"the {lay['title']} class names", hint), name)
    names = meta.get(lay["names_key"])
    if not isinstance(names, list) or len(names) != lay["classes"]:
        raise ValueError(
            f"{str(base / lay['meta'])!r}: expected '{lay['names_key']}' with {lay['classes']} class names. {hint}"
        )
    out: List[ArrayDataset] = []
    for files in (lay["train"], lay["test"]):
        parts = [_read_batch(require_file(base / f, f"a {lay['title']} data batch", hint), name) for f in files]
        x = np.concatenate([p[0] for p in parts])
        y = np.concatenate([p[1] for p in parts])
        x.flags.writeable = False  # shared by every run of this process (cached)
        y.flags.writeable = False
        out.append(ArrayDataset(x=x, y=y, num_classes=lay["classes"]))
    return out[0], out[1], tuple(str(n) for n in names)


def load_cifar(name: str, data_dir: Optional[str], download: bool = False) -> Tuple[ArrayDataset, ArrayDataset]:
    """(train, test) of ``name`` ("cifar10" / "cifar100") from ``data_dir``; uint8 images [N, 3, 32, 32].

    Loaded once per process (runs of several seeds share the arrays, which are read-only).
    """
    lay = _layout(name)
    root = data_root(data_dir, name, how_to_get(name))
    if download:
        _download(name, root)
    # data_dir may be the folder that holds cifar-*/ (torchvision's root) or that folder itself
    itself = (root / lay["meta"]).is_file() or (root / lay["train"][0]).is_file()
    base = first_existing_dir(
        root,
        [lay["folder"], ""] if itself else [lay["folder"]],
        f"the {lay['title']} folder {lay['folder']!r}",
        how_to_get(name, str(root)),
    )
    # the cache key includes each file's size and mtime: replaced files are read again
    stamp = tuple(
        (f, st.st_size, st.st_mtime_ns)
        for f in lay["train"] + lay["test"] + [lay["meta"]]
        if (base / f).is_file()
        for st in [(base / f).stat()]
    )
    train, test, _ = _load_cached(name, str(base.resolve()), stamp)
    return train, test
