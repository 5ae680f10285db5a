"""Checkpoint layouts: which checkpoints in a listing of checkpoint.dir are complete.

Pure code: the lead runs `LISTING_COMMAND` on the instance, `parse_listing` turns its output
into entries, `complete_checkpoints` says which checkpoints are whole, oldest first by step.
Each layout is one small module with one class registered in `LAYOUTS`; a new layout is one
new file plus one line here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from relaunch.errors import UsageError
from relaunch.layouts.accelerate import AccelerateLayout
from relaunch.layouts.base import Checkpoint, Entry, Layout, glob_regex
from relaunch.layouts.dcp import DcpLayout
from relaunch.layouts.deepspeed import DeepSpeedLayout
from relaunch.layouts.files import FilesLayout
from relaunch.layouts.hf_trainer import HfTrainerLayout
from relaunch.layouts.lightning import LOGGER_DIRS, LightningLayout
from relaunch.layouts.listing import LISTING_COMMAND, parse_listing

__all__ = [
    "AUTO",
    "Checkpoint",
    "Entry",
    "LAYOUTS",
    "LISTING_COMMAND",
    "Layout",
    "complete_checkpoints",
    "detect_layout",
    "layout_names",
    "parse_listing",
]

AUTO = "auto"

LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        FilesLayout(),
        HfTrainerLayout(),
        DcpLayout(),
        DeepSpeedLayout(),
        LightningLayout(),
        AccelerateLayout(),
    )
}

_HF_MARKER = re.compile(r"checkpoint-\d+/trainer_state\.json")
_DCP_MARKER = re.compile(r"[^./][^/]*/\.metadata")
_DEEPSPEED_DIR = re.compile(r"global_step\d+")
_ACCELERATE_DIR = re.compile(r"(checkpoints/)?checkpoint_\d+")


def layout_names() -> list[str]:
    """What `checkpoint.layout` accepts."""
    return [AUTO, *LAYOUTS]


def detect_layout(entries: Iterable[Entry]) -> str:
    """What `layout: auto` resolves to for this listing.

    hf-trainer if any `checkpoint-N/trainer_state.json`, else dcp if any top-level folder holds
    `.metadata` (lightning if all such folders are `*.ckpt/`), else (beyond the original rule,
    so that auto does not silently find nothing)
    deepspeed if any `global_stepN/` folder, accelerate if any `checkpoints/checkpoint_N/`,
    lightning if any top-level `*.ckpt` file or any in Lightning's `[lightning_logs/]version_N/checkpoints/`;
    else files.
    """
    entries = list(entries)
    paths = [e.path for e in entries]
    if any(_HF_MARKER.fullmatch(p) for p in paths):
        return "hf-trainer"
    with_metadata = {p.split("/", 1)[0] for p in paths if _DCP_MARKER.fullmatch(p)}
    if with_metadata:
        # Lightning's sharded `epoch=3-step=1200.ckpt/` folders are DCP inside; the lightning
        # layout reads their step right and also sees the plain `*.ckpt` files beside them.
        if all(name.endswith(".ckpt") for name in with_metadata):
            return "lightning"
        return "dcp"
    if any(e.kind == "d" and _DEEPSPEED_DIR.fullmatch(e.path) for e in entries):
        return "deepspeed"
    if any(e.kind == "d" and _ACCELERATE_DIR.fullmatch(e.path) for e in entries):
        return "accelerate"
    if any(e.kind == "f" and ("/" not in e.path and e.path.endswith(".ckpt") or LOGGER_DIRS.fullmatch(e.path))
           for e in entries):
        return "lightning"
    return "files"


def get_layout(name: str) -> Layout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise UsageError(
            f"unknown checkpoint layout {name!r}",
            hint="checkpoint.layout is one of: " + ", ".join(layout_names()),
        ) from None


def complete_checkpoints(
    entries: Iterable[Entry], layout: str, pattern: str = "ckpt-*.pt"
) -> list[Checkpoint]:
    """The complete checkpoints in a listing, OLDEST FIRST by step number.

    `layout` is a name from `layout_names()`; `auto` resolves with `detect_layout`. `pattern`
    is only used by the `files` layout. An unknown layout or a bad pattern is a UsageError.
    """
    entries = list(entries)
    glob_regex(pattern)  # a bad pattern is a usage error whichever layout is used
    if layout == AUTO:
        layout = detect_layout(entries)
    return get_layout(layout).complete(entries, pattern)
