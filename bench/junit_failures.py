"""The tests that failed or errored, by pytest node id, from pytest's junit XML files: what
bench/gpu_check.sh's summary lists, so that a GPU run says which tests to look at.

    python -m bench.junit_failures junit-tests.xml junit-tests_wide.xml

prints a Markdown section: one line per failing test (node id, and the first line of pytest's
message), "none" when every test passed, or why a file could not be read (a phase cut before
pytest wrote it).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import List, NamedTuple, Optional, Sequence

MAX_LISTED = 200  # the summary stays readable when a whole file fails


class Failure(NamedTuple):
    node_id: str
    kind: str  # "failed" or "error" (in setup or teardown)
    message: str


def node_id(classname: str, name: str, root: Path) -> str:
    """pytest's node id from a junit case: ``classname`` is the module's dotted path, then any
    classes; the longest prefix that is a file under ``root`` is the module."""
    parts = classname.split(".") if classname else []
    for i in range(len(parts), 0, -1):
        path = "/".join(parts[:i]) + ".py"
        if (root / path).is_file():
            return "::".join([path, *parts[i:], name])
    return "::".join([p for p in (classname, name) if p])


def failures(path: Path, root: Path) -> List[Failure]:
    """Every failed or errored test case of one junit file, in file order."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        for kind, tag in (("failed", "failure"), ("error", "error")):
            found = case.find(tag)
            if found is not None:
                message = (found.get("message") or found.text or "").strip().splitlines()
                where = node_id(case.get("classname", ""), case.get("name", ""), root)
                out.append(Failure(where, kind, message[0] if message else ""))
    return out


def section(paths: Sequence[Path], root: Optional[Path] = None) -> str:
    """The summary's "Failed tests" section for these junit files."""
    root = Path.cwd() if root is None else root
    lines = [f"## Failed tests ({', '.join(p.name for p in paths) or 'no junit file'})", ""]
    found: List[Failure] = []
    for path in paths:
        try:
            found += failures(path, root)
        except (OSError, ET.ParseError) as exc:
            why = f"{type(exc).__name__}: {exc}"
            lines.append(f"- {path.name} unreadable ({why}): the phase stopped before pytest wrote it")
    for f in found[:MAX_LISTED]:
        message = f.message if len(f.message) <= 160 else f.message[:157] + "..."
        lines.append(f"- `{f.node_id}` ({f.kind}{': ' + message if message else ''})")
    if len(found) > MAX_LISTED:
        lines.append(f"- ... and {len(found) - MAX_LISTED} more (the junit files have them all)")
    if not found and len(lines) == 2:
        lines.append("none")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    print(section([Path(a) for a in argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
