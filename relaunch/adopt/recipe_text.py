"""The adopted recipe as YAML text: every key with a comment above it saying where its value came
from, `GUESS:` where adopt could not read it for sure. Pure."""

from __future__ import annotations

import json
import re
from typing import Any

ORDER = ["name", "provider", "extends", "ssh", "env", "checkpoint", "run", "guard", "recover", "templates"]
SUBORDER = {
    "ssh": ["user", "port", "key", "host_key", "wait"],
    "env": ["python", "venv", "installer", "lock", "index_url", "extra_index_urls", "system_site_packages", "apt",
            "files", "setup", "vars", "secrets"],
    "checkpoint": ["dir", "layout", "pattern", "keep", "remote", "via", "every", "streams"],
    "run": ["command", "workdir", "session", "log", "ready", "grace", "nproc_per_node", "stop", "batch", "metrics"],
}
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./~-]*")
_YAML_WORDS = {"true", "false", "yes", "no", "on", "off", "null", "y", "n", "~"}
WIDTH = 110


def scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value), ensure_ascii=False)     # a JSON string is a YAML double-quoted scalar


def key_text(key: str) -> str:
    plain = _PLAIN_KEY.fullmatch(key) and key.lower() not in _YAML_WORDS and not re.fullmatch(r"[\d.eE+-]+", key)
    return key if plain else json.dumps(key, ensure_ascii=False)


def _comment(note: tuple[str, bool] | None, indent: str) -> list[str]:
    if note is None:
        return []
    text, guess = note
    text = ("GUESS: " if guess else "") + " ".join(text.split())
    lines, line = [], ""
    for word in text.split(" "):
        if line and len(indent) + 2 + len(line) + 1 + len(word) > WIDTH:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    lines.append(line)
    return [f"{indent}# {ln}" for ln in lines]


def _ordered(data: dict[str, Any], order: list[str]) -> list[str]:
    return [k for k in order if k in data] + [k for k in data if k not in order]


def _emit(data: dict[str, Any], notes: dict[str, tuple[str, bool]], path: str, depth: int) -> list[str]:
    out: list[str] = []
    indent = "  " * depth
    order = ORDER if not path else SUBORDER.get(path, [])
    for key in _ordered(data, order):
        value = data[key]
        dotted = f"{path}.{key}" if path else key
        if depth == 0 and isinstance(value, dict) and out and out[-1] != "":
            out.append("")
        out += _comment(notes.get(dotted), indent)
        if isinstance(value, dict) and value:
            out.append(f"{indent}{key_text(key)}:")
            out += _emit(value, notes, dotted, depth + 1)
        elif isinstance(value, dict):
            out.append(f"{indent}{key_text(key)}: {{}}")
        elif isinstance(value, list):
            out.append(f"{indent}{key_text(key)}: [{', '.join(scalar(v) for v in value)}]")
        else:
            out.append(f"{indent}{key_text(key)}: {scalar(value)}")
        if depth == 0 and isinstance(value, dict):
            out.append("")
    return out


def recipe_text(data: dict[str, Any], notes: dict[str, tuple[str, bool]], header: str) -> str:
    lines = _comment((header, False), "") + [""]
    lines += _emit(data, notes, "", 0)
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` deep-merged into `base` (a list or scalar replaces), as `--set` merges into a recipe."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def dotted_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys of the values in `data` (not of the sections that hold them)."""
    keys = []
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            keys += dotted_keys(value, dotted + ".")
        else:
            keys.append(dotted)
    return keys
