"""One watch per recipe and store: what the watch holds is given back however it stops, and the
lease in the store changes only by compare-and-set.

Real stores: a local folder, a Hub repo (tests/hubserver.py, which refuses a commit whose parent is
not the head, as the Hub does) and an S3 bucket through rclone (`rclone serve s3`). The Ctrl-C is
raised where a signal can land, inside the store write that records the lease (CI caught it
there: the lease stayed and the next watch had to `--take-over`); the race of two watches is
made by letting the second one take the store between the first one's read and its write.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from e2e import plain_recipe
from relaunch import processes
from relaunch.errors import RelaunchError, UsageError
from relaunch.recipe.loader import load_recipe
from relaunch.transports import open_store
from relaunch.transports.hf import HfStore
from relaunch.transports.local import LocalPathStore
from relaunch.transports.rclone import RcloneStore
from relaunch.ui import UI
from relaunch.watch.holder import Holder


@pytest.fixture()
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RELAUNCH_HOME", str(tmp_path / "state"))
    recipe = load_recipe(str(plain_recipe(tmp_path, name="held", key=tmp_path / "key")))
    return open_store(recipe)


def lease(store) -> dict:
    return json.loads(store.read_meta("watch.json") or "null")


def test_a_ctrl_c_while_the_lease_is_written_still_gives_it_back(store, monkeypatch):
    holder = Holder("held", store, ["root@10.0.0.9:22"])
    swap, landed = store.swap_meta, []

    def interrupted(*args: object) -> bool:
        swap(*args)                               # the lease is in the store, then the signal lands
        if not landed:
            landed.append(True)
            raise KeyboardInterrupt
        return True

    monkeypatch.setattr(store, "swap_meta", interrupted)
    with pytest.raises(KeyboardInterrupt):
        holder.take(UI())
    monkeypatch.setattr(store, "swap_meta", swap)
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


def make_store(kind: str, request, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An empty store of that kind (local, hf, rclone) for the lease."""
    monkeypatch.setenv("RELAUNCH_HOME", str(tmp_path / "state"))
    if kind == "local":
        return LocalPathStore(tmp_path / "store", "held")
    if kind == "hf":
        hub = request.getfixturevalue("hf_hub")(lfs_threshold=100_000)      # the lease: a regular file
        return HfStore("acme/ckpts", "run1", "held", hub.token, hub.url)
    s3 = request.getfixturevalue("s3_remote")()
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    return RcloneStore(s3.name, f"{s3.bucket}/held", "held")


@pytest.fixture(params=["local", "hf", "rclone"])
def any_store(request, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    return make_store(request.param, request, tmp_path, monkeypatch)


def elsewhere(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What follows runs as a watch on another machine would: its own state folder (lock, state)."""
    monkeypatch.setenv("RELAUNCH_HOME", str(tmp_path / "other-machine"))


def test_a_watch_that_was_taken_over_does_not_take_the_lease_back(any_store, tmp_path, monkeypatch):
    """Its renewal finds the other watch's lease where its own was: it writes nothing, and says
    who took the store; giving back leaves the other's lease alone."""
    first = Holder("held", any_store, ["root@10.0.0.9:22"])
    first.take(UI())
    here = os.environ["RELAUNCH_HOME"]
    elsewhere(monkeypatch, tmp_path)
    second = Holder("held", any_store, ["root@10.0.0.9:22"])
    second.token = "gpu-box:4242:1.000"
    second.take(UI(), take_over=True)
    monkeypatch.setenv("RELAUNCH_HOME", here)
    held = first.renew(UI())
    assert lease(any_store)["token"] == second.token              # nothing written over the other's lease
    assert held is False and first.taken is not None and first.taken["token"] == second.token
    assert first.why_not_mine() is not None and "another watch holds the store now" in first.why_not_mine()
    assert lease(any_store)["token"] == second.token
    first.release(UI())
    assert lease(any_store)["token"] == second.token
    assert second.renew(UI()) is True and second.why_not_mine() is None


@pytest.mark.parametrize("kind", ["local", "hf"])
def test_of_two_watches_taking_the_store_at_once_one_gets_it(kind, request, tmp_path, monkeypatch):
    """Stores with a real compare-and-set (a lock on the folder; a commit against the head): the
    second watch takes the store between the first one's read of the lease (none there) and its
    write. The first one's write must not replace the second's lease: it looks again and refuses."""
    store = make_store(kind, request, tmp_path, monkeypatch)
    first = Holder("held", store, ["root@10.0.0.9:22"])
    second = Holder("held", store, ["root@10.0.0.9:22"])
    second.token = "gpu-box:4242:1.000"
    here, read = os.environ["RELAUNCH_HOME"], store.read_meta
    raced: list[bool] = []

    def read_then_race(filename: str) -> str | None:
        text = read(filename)
        if not raced:                             # the first watch's read: the second one takes it now
            raced.append(True)
            elsewhere(monkeypatch, tmp_path)
            second.take(UI())
            monkeypatch.setenv("RELAUNCH_HOME", here)
        return text

    monkeypatch.setattr(store, "read_meta", read_then_race)
    with pytest.raises(UsageError, match="holds the store"):
        first.take(UI())
    assert raced and lease(store)["token"] == second.token


def test_a_ctrl_c_gives_the_lease_back_on_every_kind_of_store(any_store):
    """A Ctrl-C ends every wait in relaunch (processes.CANCEL): the watch's last act, giving back its
    lease, must not be ended with them. Found by the chaos test: on the Hub, a watch stopped with
    Ctrl-C left its lease in the store, and the next watch was refused for 15 min without --take-over."""
    holder = Holder("held", any_store, ["root@10.0.0.9:22"])
    holder.take(UI())
    assert lease(any_store)["token"] == holder.token
    processes.CANCEL.set()                        # what the CLI's Ctrl-C handler does first
    try:
        holder.release(UI())
    finally:
        processes.CANCEL.clear()
    assert lease(any_store) == {}


def test_a_renewal_whose_answer_was_lost_keeps_the_lease(request, tmp_path, monkeypatch):
    """The Hub makes the renewal's commit and the connection is cut before its answer: the lease in
    the store is this watch's, with that renewal's time in it. The next renewal must know it by its
    token and renew it; comparing the text, it took its own lease for another watch's and the watch
    stopped ("another watch took the store: pid <its own>"), leaving the run unwatched."""
    store = make_store("hf", request, tmp_path, monkeypatch)
    hub = request.getfixturevalue("hf_hub").servers[-1]
    holder = Holder("held", store, ["root@10.0.0.9:22"])
    holder.take(UI())
    hub.drop_reply("watch.json")
    with pytest.raises(RelaunchError):
        holder.renew(UI())                      # its write landed; its answer did not
    assert [r for r in hub.log if r[2] == 0] and lease(store)["token"] == holder.token
    assert holder.renew(UI()) is True and holder.taken is None
    assert holder.why_not_mine() is None
    assert lease(store)["token"] == holder.token
    holder.release(UI())
    assert lease(store) == {}


def test_a_look_at_the_lease_after_a_lost_answer_finds_it_this_watchs(request, tmp_path, monkeypatch):
    """The same lost answer, seen first by the look before renting (why_not_mine), not by a renewal."""
    store = make_store("hf", request, tmp_path, monkeypatch)
    hub = request.getfixturevalue("hf_hub").servers[-1]
    holder = Holder("held", store, ["root@10.0.0.9:22"])
    holder.take(UI())
    hub.drop_reply("watch.json")
    with pytest.raises(RelaunchError):
        holder.renew(UI())
    assert holder.why_not_mine() is None and holder.taken is None
    assert holder.renew(UI()) is True
    holder.release(UI())
    assert lease(store) == {}
