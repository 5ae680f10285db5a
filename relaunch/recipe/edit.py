"""Small edits of a recipe file in place, keeping its comments and layout (for `relaunch freeze`).

A key the file writes in block style is changed on its own line (the value replaced, a comment after
it kept; a block list gains items after its last one); a key it does not write takes the place of its
commented-out example in the top-level `env:` block (`# lock: ...`, as `relaunch init` writes them),
else gets a new line at the end of that block (or a new `env:` block at the end of the file). Anything else
(a flow mapping, a list spread over lines in flow style) is refused with where and what to write
by hand: relaunch never rewrites a user's file wholesale.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import yaml

from ..errors import UsageError

_KEY_LINE = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z_][A-Za-z0-9_]*)\s*:(?P<rest>.*)$")
_ENV_LINE = re.compile(r"^env\s*:\s*(#.*)?$")


@dataclass(frozen=True)
class Edit:
    """Set env.`key` to `value` (a string or a list of strings); `line`: the 1-based line of the key
    in this file when the file writes it there, else None (add it under env:)."""

    key: str
    value: str | list[str]
    line: int | None = None


def scalar(text: str) -> str:
    """`text` as a YAML scalar: plain where YAML reads it back unchanged, also as an item of a flow
    list (`${NAME}` is not: `{` opens a mapping there), else double-quoted."""
    try:
        plain_ok = (yaml.safe_load(f"k: {text}") == {"k": text} and yaml.safe_load(f"k: [{text}]") == {"k": [text]}
                    and " #" not in text)
    except yaml.YAMLError:
        plain_ok = False
    return text if plain_ok and text.strip() == text and text else json.dumps(text)


def flow_list(values: list[str]) -> str:
    return "[" + ", ".join(scalar(v) for v in values) + "]"


def _split_comment(rest: str) -> tuple[str, str]:
    """(value, ` # comment` with the spaces before it) of the text after `key:`."""
    quote = ""
    for i, c in enumerate(rest):
        if quote:
            if c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or rest[i - 1] in " \t"):
            value = rest[:i].rstrip()
            return value, rest[len(value):]
    return rest.rstrip(), ""


def _refuse(path: str, line: int | None, key: str, value: str | list[str], why: str) -> UsageError:
    where = f"{path}:{line}" if line else path
    shown = flow_list(value) if isinstance(value, list) else scalar(value)
    return UsageError(f"{where}: cannot edit env.{key} in place: {why}",
                      f"write `{key}: {shown}` under env: yourself, then rerun `relaunch freeze`")


def _block_items(lines: list[str], index: int, indent: int) -> int:
    """Index of the last line of the block list under the key at `index` (the key's own index if none)."""
    last = index
    for j in range(index + 1, len(lines)):
        stripped = lines[j].strip()
        if not stripped or stripped.startswith("#"):
            continue
        own = len(lines[j]) - len(lines[j].lstrip())
        if stripped.startswith("- ") or stripped == "-":
            if own < indent:
                break
            last = j
        elif own > indent and last != index:
            last = j                      # an item's continuation line
        else:
            break
    return last


def _edit_line(lines: list[str], path: str, edit: Edit) -> None:
    assert edit.line is not None
    i = edit.line - 1
    m = _KEY_LINE.match(lines[i]) if i < len(lines) else None
    if m is None or m.group("key") != edit.key:
        raise _refuse(path, edit.line, edit.key, edit.value, "the line does not start with the key (flow style?)")
    value, comment = _split_comment(m.group("rest"))
    value = value.strip()
    head = f"{m.group('indent')}{edit.key}: "
    if isinstance(edit.value, str):
        lines[i] = head + scalar(edit.value) + comment
        return
    if value.startswith("[") and value.endswith("]"):
        lines[i] = head + flow_list(edit.value) + comment
        return
    if value:
        raise _refuse(path, edit.line, edit.key, edit.value, "its value is not a list on one line")
    # a block list: keep its items (and their comments), add the new ones after the last
    indent = len(m.group("indent"))
    last = _block_items(lines, i, indent)
    items = [ln for ln in lines[i + 1:last + 1] if ln.strip().startswith("-")]
    have = yaml.safe_load("\n".join(lines[i:last + 1])) or {}
    present = have.get(edit.key) or [] if isinstance(have, dict) else []
    prefix = (items[0][:len(items[0]) - len(items[0].lstrip())] if items else " " * (indent + 2)) + "- "
    added = [prefix + scalar(v) for v in edit.value if v not in present]
    lines[last + 1:last + 1] = added


def _add_under_env(lines: list[str], path: str, edit: Edit) -> None:
    rendered = scalar(edit.value) if isinstance(edit.value, str) else flow_list(edit.value)
    start = next((i for i, ln in enumerate(lines) if _ENV_LINE.match(ln)), None)
    if start is None:
        if any(re.match(r"^env\s*:", ln) for ln in lines):
            raise _refuse(path, None, edit.key, edit.value, "its env: is written in flow style")
        if lines and lines[-1].strip():
            lines.append("")
        lines += ["env:", f"  {edit.key}: {rendered}"]
        return
    indent, last = None, start
    example = None                        # `# key: ...`, the key commented out (a starter recipe's)
    for j in range(start + 1, len(lines)):
        stripped = lines[j].strip()
        if not stripped:
            continue
        own = len(lines[j]) - len(lines[j].lstrip())
        if own == 0:
            break                         # the next top-level key (or a comment about it)
        if indent is None and not stripped.startswith("#"):
            indent = own
        if example is None and re.match(rf"#\s*{edit.key}\s*:", stripped):
            example = j
        last = j
    if example is not None and len(lines[example]) - len(lines[example].lstrip()) == (indent or 2):
        # the commented-out example becomes the key, its comment after the value kept in its column
        _, comment = _split_comment(lines[example].split(":", 1)[1])
        line = f"{' ' * (indent or 2)}{edit.key}: {rendered}"
        column = len(lines[example]) - len(comment.lstrip())
        lines[example] = line + (comment.lstrip().rjust(len(comment.lstrip()) + max(column - len(line), 1))
                                 if comment else "")
        return
    lines.insert(last + 1, f"{' ' * (indent or 2)}{edit.key}: {rendered}")


def apply(text: str, path: str, edits: list[Edit]) -> str:
    """`text` (a recipe file) with `edits` made; raises UsageError where one cannot be made in place.
    Edits are made bottom-up, so that each recorded line number still points at its key."""
    lines = text.splitlines()
    for edit in sorted(edits, key=lambda e: -(e.line or 0)):
        if edit.line is not None:
            _edit_line(lines, path, edit)
    for edit in edits:
        if edit.line is None:
            _add_under_env(lines, path, edit)
    return "\n".join(lines) + ("\n" if text.endswith("\n") or not text else "")
