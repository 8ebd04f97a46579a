"""Writing a benchmark's part of benchmarks/RESULTS.md, leaving the rest as it is.

A part is a `## ` section (`write_section`), or a `### ` block inside one
(`write_block`); either is replaced when present and appended when not. With
`PIPELANG_RESULTS_COPY` set (benchmarks/gpu_batch.sh sets it to `$OUT/RESULTS.md`), every
write also copies the file there at once, so a run that is cut off still returns what it
measured.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def _copied() -> None:
    """Copy RESULTS.md where `PIPELANG_RESULTS_COPY` says, if it says."""
    target = os.environ.get("PIPELANG_RESULTS_COPY")
    if target:
        shutil.copyfile(RESULTS, target)


def _section_bounds(doc: str, section: str) -> tuple[int, int]:
    """Start and end of `section` (a `## ` heading line) in `doc`; (-1, -1) if absent."""
    start = doc.find(section)
    if start < 0:
        return -1, -1
    end = doc.find("\n## ", start + len(section))
    return start, len(doc) if end < 0 else end + 1


def write_section(section: str, text: str) -> None:
    """Put `text`, which starts with the heading `section`, in place of that section."""
    doc = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    start, end = _section_bounds(doc, section)
    if start < 0:
        RESULTS.write_text(doc.rstrip("\n") + "\n\n" + text)
    else:
        rest = doc[end:]
        RESULTS.write_text(doc[:start] + text + ("\n" + rest if rest else ""))
    _copied()


def write_block(section: str, intro: str, heading: str, text: str) -> None:
    """Put `text` (which starts with `heading`, a `###` line) under `section`, replacing
    the block of that heading if there is one; a missing section is made with `intro`."""
    doc = RESULTS.read_text()
    if section not in doc:
        doc = doc.rstrip("\n") + f"\n\n{section}\n\n{intro}\n"
    start, end = _section_bounds(doc, section)
    part = doc[start:end].rstrip("\n") + "\n"
    if heading in part:
        a = part.index(heading)
        b = part.find("\n### ", a + len(heading))
        part = part[:a] + text + ("" if b < 0 else "\n" + part[b + 1 :])
    else:
        part = part + "\n" + text
    rest = doc[end:]
    RESULTS.write_text(doc[:start] + part.rstrip("\n") + "\n" + ("\n" + rest if rest else ""))
    _copied()
