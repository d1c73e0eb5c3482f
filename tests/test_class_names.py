"""No two classes with one name across the package and the benchmark suite.

A name a reader meets in two places means two things to them: the package's ``Algo``
(``fl/catalogue.py``) and the benchmark's (``BenchAlgo``), the descriptors' ``Setting`` and the
benchmark's model settings (``ModelSetting``). Every class defined at any depth of a module of
``fedopt_kernels/``, ``triton_kernels/`` or ``bench/`` is counted, nested ones included.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterable, List

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("fedopt_kernels", "triton_kernels", "bench")


def classes(paths: Iterable[Path]) -> Dict[str, List[str]]:
    """class name -> ``file:line`` of every class of that name in ``paths``."""
    out: Dict[str, List[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                out.setdefault(node.name, []).append(f"{where}:{node.lineno}")
    return out


def duplicates(paths: Iterable[Path]) -> Dict[str, List[str]]:
    return {name: where for name, where in classes(paths).items() if len(where) > 1}


def sources() -> List[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def test_no_two_classes_share_a_name():
    assert duplicates(sources()) == {}


def test_the_class_name_check_can_fail(tmp_path):
    (tmp_path / "a.py").write_text("class Algo:\n    pass\n")
    (tmp_path / "b.py").write_text("def f():\n    class Algo:\n        pass\n")
    found = duplicates([tmp_path / "a.py", tmp_path / "b.py"])
    assert list(found) == ["Algo"] and [w.rsplit(":", 1)[1] for w in found["Algo"]] == ["1", "2"]
