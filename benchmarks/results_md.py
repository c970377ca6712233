"""RESULTS.md sections that a benchmark script owns: written between its two markers, the rest
of the file kept (``make bench`` regenerates the top with ``run.py``, keeps its hand-written
notes block, then each script (re)writes its own section)."""
from __future__ import annotations


def write_section(path: str, section: str, begin: str, end: str) -> None:
    """Replace the text from ``begin`` to ``end`` in ``path`` with ``section`` (which starts
    with ``begin`` and ends with ``end``), or append it when the markers are not there."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        text = ""
    if begin in text and end in text:
        text = text[:text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
