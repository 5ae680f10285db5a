"""The guesses a recipe file marks: a comment line starting `GUESS:` in the comments right above a
key (as `relaunch adopt` writes them) says that key's value was guessed. The user confirms a guess
by deleting `GUESS:` from that comment (or the whole comment); `relaunch check` lists those left.
Pure.
"""

from __future__ import annotations

import re

_MARKED = re.compile(r"#\s*GUESS:\s*(.*)")


def marked_lines(text: str, key_lines: set[int]) -> dict[int, str]:
    """{line of a key: what its GUESS comment says} for each of `key_lines` (1-based) whose comment
    block, the comment lines right above it up to a blank or other line, holds a GUESS: line. The
    text is that line and the comment lines after it in the block (a long comment wraps)."""
    rows = text.splitlines()
    found: dict[int, str] = {}
    for line in key_lines:
        block: list[str] = []
        n = line - 2                      # the row above the key, 0-based
        while n >= 0 and rows[n].lstrip().startswith("#"):
            block.insert(0, rows[n].strip())
            n -= 1
        for at, row in enumerate(block):
            m = _MARKED.match(row)
            if m:
                rest = [r.lstrip("#").strip() for r in block[at + 1:]]
                found[line] = " ".join(w for w in [m[1], *rest] if w)
                break
    return found
