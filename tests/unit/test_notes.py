"""The Notes: every Note a comment names exists, once, and docs/internals.md lists each."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
SOURCES = [p for p in (ROOT / "csrc").rglob("*") if p.suffix in {".h", ".cpp", ".cu", ".cuh"}]
SOURCES += list((ROOT / "hsync").rglob("*.py"))
DEFINITION = re.compile(r"^(?://|#)?\s*Note \[([^\]]+)\]\s*$", re.MULTILINE)
REFERENCE = re.compile(r"Note\s+\[([^\]]+)\]")


def test_every_note_named_exists_once_and_is_indexed():
    defined: dict[str, list[Path]] = {}
    named: dict[str, set[Path]] = {}
    for path in SOURCES:
        text = path.read_text()
        for title in DEFINITION.findall(text):
            defined.setdefault(title, []).append(path)
        for title in REFERENCE.findall(text):
            named.setdefault(" ".join(title.split()), set()).add(path)
    assert len(defined) > 20, "no Notes found: the pattern no longer matches"
    assert {t: p for t, p in defined.items() if len(p) > 1} == {}, "a Note defined twice"
    assert {t: sorted(map(str, p)) for t, p in named.items() if t not in defined} == {}, "Notes named, not defined"
    index = (ROOT / "docs" / "internals.md").read_text()
    listed = set(re.findall(r"^\| \[([^\]]+)\] \| `([^`]+)`", index, re.MULTILINE))
    assert listed == {(t, str(p[0].relative_to(ROOT))) for t, p in defined.items()}
