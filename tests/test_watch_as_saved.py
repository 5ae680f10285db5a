"""`relaunch watch` copies each checkpoint off as it is saved: a new complete checkpoint on the
instance starts a round within seconds, whatever `checkpoint.every` says (the longest time between
rounds, no longer the only trigger); the exposure (the steps the store's newest verified checkpoint
is behind the instance's newest) is measured at every look, said when the copies fall behind the
saves, and shown by `relaunch status`.
"""

from __future__ import annotations

import json
import time

from e2e import run_cli, wait_for
from relaunch import sandbox as sb
from relaunch.sandbox import network
from relaunch.sandbox.instance import RUN_DIR
from test_guard import watching
from test_watch_unattended import err_of, events, manifest, spot_recipe

SAVE_EVERY = 25              # steps between saves; a step every 0.2 s: a save every ~5 s
SAMPLING = 75.0              # seconds of samples


def newest_on(inst: sb.Instance) -> int:
    """The instance's newest complete checkpoint (spot_trainer renames each into place whole), read
    from inside it: no SSH connection per sample."""
    names = sb.run_in(inst.name, ["ls", f"{inst.home}/ckpt"], capture_output=True, text=True, timeout=30).stdout
    steps = [int(n[len("ckpt-"):-len(".pt")]) for n in names.split() if n.startswith("ckpt-") and n.endswith(".pt")]
    return max(steps, default=0)


def stored_newest(store) -> int:
    checkpoints = manifest(store)["checkpoints"]
    return max((c["step"] for c in checkpoints), default=0)


def test_each_checkpoint_is_copied_as_it_is_saved_with_the_default_checkpoint_every(tmp_path, sandbox, ssh, ssh_key):
    """checkpoint.every left at its default (600 s), a save every ~5 s: sampled for more than a minute,
    the store is never more than two saves behind the instance (a watch that copied every
    checkpoint.every seconds was dozens of saves behind after the first round). Then the link slows
    down so much that a copy takes longer than a save: the watch says the exposure once the copies
    fall behind and again when they catch up, and `status` shows what the watch measured."""
    home, inst = tmp_path / "state", sandbox()
    name = "assaved"
    # a look every second (guard.every): a round starts within about a second of a save; the store
    # keeps one checkpoint, so a round copies one (on two loaded cores a round takes seconds, and
    # its length, not when it starts, is what bounds the exposure at a save every 5 s)
    recipe = spot_recipe(tmp_path, name, ssh_key, size=200_000, every=SAVE_EVERY, keep=3, sleep=0.2,
                         guard={"every": 1}, checkpoint={"keep": 1})
    store = tmp_path / "store"
    assert run_cli("up", str(recipe), inst.host, home=home).returncode == 0
    with watching(recipe, home, tmp_path) as watch:
        wait_for("the first verified checkpoint", lambda: stored_newest(store) > 0, timeout=120,
                 explain=lambda: err_of(tmp_path))
        samples: list[tuple[int, int]] = []
        end = time.monotonic() + SAMPLING
        while time.monotonic() < end:
            on_instance = newest_on(inst)             # first: the store read after it can only be newer
            samples.append((on_instance, stored_newest(store)))
            time.sleep(0.5)
        behind = [(i, s) for i, s in samples if i - s > 2 * SAVE_EVERY]
        assert not behind, f"more than two saves behind: {behind[:10]}\n{err_of(tmp_path)[-3000:]}"
        assert samples[-1][1] - samples[0][1] >= 8 * SAVE_EVERY, samples    # and it kept copying
        assert "a sync round as each checkpoint is saved (at least every 600s)" in err_of(tmp_path)

        # a link too slow for the saves: 1.6 Mbit a checkpoint at 200 kbit/s, a save every 5 s
        slot = int((RUN_DIR / inst.name / "slot").read_text())
        network.shape(inst.name, slot, "200kbit")
        slowed = len(events(tmp_path))

        def exposure_said(behind: bool, after: int) -> dict | None:
            return next((e for e in events(tmp_path)[after:] if e["event"] == "exposure"
                         and (e["behind"] >= 2) == behind), None)

        said = wait_for("the exposure said", lambda: exposure_said(True, slowed), timeout=120,
                        explain=lambda: err_of(tmp_path))
        assert said["lag_steps"] >= 2 * SAVE_EVERY, said
        network.set_silent(inst.name, slot, False)            # the link's full speed again
        fast = len(events(tmp_path))
        back = wait_for("the store caught up", lambda: exposure_said(False, fast), timeout=120,
                        explain=lambda: err_of(tmp_path))
        assert back["lag_steps"] <= SAVE_EVERY, back
        err = err_of(tmp_path)
        assert f"exposure {said['lag_steps']} steps" in err and "the copies fall behind the saves" in err
        assert "the copies keep up with the saves again" in err

        status = run_cli("status", str(recipe), "--json", home=home)
        assert status.returncode == 0, status.stderr
        seen = json.loads(status.stdout)["watch"]
        assert seen["running"] and seen["exposure_most"]["lag_steps"] >= said["lag_steps"], seen
        assert seen["exposure"]["newest_step"] >= back["newest_step"], seen
        text = run_cli("status", str(recipe), home=home).stdout
        assert "    exposure at " in text and "    the most since the watch started: " in text, text
        assert watch.poll() is None, err_of(tmp_path)
