"""One watch per recipe and store: what the watch holds is given back however it stops.

A real local store; the Ctrl-C is raised where a signal can land, inside the store write that
records the lease (CI caught it there: the lease stayed and the next watch had to `--take-over`).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from relaunch.errors import UsageError
from relaunch.recipe.loader import load_recipe
from relaunch.transports import open_store
from relaunch.ui import UI
from relaunch.watch.holder import Holder

from e2e import plain_recipe


@pytest.fixture()
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RELAUNCH_HOME", str(tmp_path / "state"))
    recipe = load_recipe(str(plain_recipe(tmp_path, name="held", key=tmp_path / "key")))
    return open_store(recipe)


def lease(store) -> dict:
    return json.loads(store.read_meta("watch.json") or "null")


def test_a_ctrl_c_while_the_lease_is_written_still_gives_it_back(store, monkeypatch):
    holder = Holder("held", store, ["root@10.0.0.9:22"])
    flush, landed = store.flush, []

    def interrupted() -> None:
        flush()                                   # the lease is in the store, then the signal lands
        if not landed:
            landed.append(True)
            raise KeyboardInterrupt

    monkeypatch.setattr(store, "flush", interrupted)
    with pytest.raises(KeyboardInterrupt):
        holder.take(UI())
    monkeypatch.setattr(store, "flush", flush)
    assert lease(store) == {}
    # and the next watch takes it without --take-over
    again = Holder("held", store, ["root@10.0.0.9:22"])
    again.take(UI())
    assert lease(store)["token"] == again.token
    again.release(UI())
    assert lease(store) == {}


def test_a_watch_that_did_not_get_the_store_leaves_the_holders_lease_and_state(store):
    first = Holder("held", store, ["root@10.0.0.9:22"])
    first.take(UI())
    first.note(last_round={"line": "round 1"})
    second = Holder("held", store, ["root@10.0.0.9:22"])
    with pytest.raises(UsageError, match="is running here"):
        second.take(UI())
    second.release(UI())                          # as the watch's own cleanup would: a no-op
    assert lease(store)["token"] == first.token
    assert "ended" not in json.loads(first.state_path.read_text())
    first.release(UI())
    assert lease(store) == {}
