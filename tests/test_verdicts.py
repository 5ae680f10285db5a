"""Every verdict relaunch gives, from fixtures of what was observed (no network): these
observations in, this verdict and these words out. tests/fixtures/verdicts/*.json hold the cases;
the end-to-end tests of the same promises, with their faults, are in test_faults.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from relaunch import verdicts
from relaunch.manifest import Seen, StoreManifest

FIX = Path(__file__).parent / "fixtures" / "verdicts"


def cases(name: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    doc = json.loads((FIX / name).read_text())
    return [pytest.param(doc, case, id=case["case"]) for case in doc["cases"]]


@pytest.mark.parametrize("doc,case", cases("store-holds.json"))
def test_store_holds(doc: dict[str, Any], case: dict[str, Any]) -> None:
    raw = doc["record"]
    record = StoreManifest.from_dict({"format": 1, "recipe": "r", "checkpoints": [raw]}, "fixture").checkpoints[
        raw["name"]]
    seen = {path: Seen(s["size"], s["hashes"]) for path, s in case["seen"].items()}
    assert verdicts.store_holds(record, seen, case.get("size_only", False)) == case["problems"]
    assert verdicts.differing(record, seen) == case["differing"]


@pytest.mark.parametrize("doc,case", cases("nothing-to-copy.json"))
def test_nothing_to_copy(doc: dict[str, Any], case: dict[str, Any]) -> None:
    verdict = verdicts.nothing_to_copy(verdicts.Progress(**case["progress"]), case["stored_step"], case["allow_empty"])
    assert (verdict.ok, verdict.why) == (case["ok"], case["why"])


@pytest.mark.parametrize("doc,case", cases("evacuation.json"))
def test_evacuation(doc: dict[str, Any], case: dict[str, Any]) -> None:
    empty = verdicts.Verdict(**case["empty"]) if case["empty"] else None
    verdict = verdicts.evacuation(case["newest"], case["verified_now"], empty)
    assert (verdict.ok, verdict.why) == (case["ok"], case["why"])


def test_extra_hashes_survive_the_manifest() -> None:
    """The store's own hashes (md5, git blob id) recorded at verification are read back: without
    them an S3 or Hub store could only be checked by size later."""
    doc = json.loads((FIX / "store-holds.json").read_text())["record"]
    manifest = StoreManifest.from_dict({"format": 1, "recipe": "r", "checkpoints": [doc]}, "fixture")
    again = StoreManifest.from_json(manifest.to_json(), "again")
    files = again.checkpoints["checkpoint-20"].files
    assert files["checkpoint-20/model.bin"].extra == {"md5": "m1m1"}
    assert files["checkpoint-20/trainer_state.json"].extra == {"gitblob": "g2g2"}


@pytest.mark.parametrize("doc,case", cases("sync-round.json"))
def test_sync_round(doc: dict[str, Any], case: dict[str, Any]) -> None:
    verdict = verdicts.sync_round(case["at_start"], case["verified_now"], case["newest"], began=case.get("began"))
    assert (verdict.ok, verdict.why) == (case["ok"], case["why"])


@pytest.mark.parametrize("doc,case", cases("notice-saved.json"))
def test_notice_saved(doc: dict[str, Any], case: dict[str, Any]) -> None:
    seen = {**doc["base"], **case["seen"]}
    seen["verified_now"] = tuple(seen["verified_now"])
    verdict = verdicts.notice_saved(verdicts.NoticeCopy(**seen))
    assert (verdict.ok, verdict.why) == (case["ok"], case["why"])


@pytest.mark.parametrize("doc,case", cases("launched.json"))
def test_launched(doc: dict[str, Any], case: dict[str, Any]) -> None:
    verdict = verdicts.launched(case["state"])
    assert (verdict.ok, verdict.why) == (case["ok"], case["why"])


@pytest.mark.parametrize("doc,case", cases("end-replaced.json"))
def test_end_replaced(doc: dict[str, Any], case: dict[str, Any]) -> None:
    verdict = verdicts.end_replaced(case["listed"], case["newest"], case["newest_step"], case["held"],
                                    case["held_step"])
    assert (verdict.ok, verdict.why) == (case["ok"], case["why"])
