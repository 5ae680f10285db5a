"""The watch's copy-off rounds as the loop sees them, with real children (no instance): a child
that exits 1 is an internal error, said once and never tried again."""

from __future__ import annotations

import sys
from pathlib import Path

from e2e import wait_for

from relaunch.watch.rounds import Rounds, child_argv


def test_a_round_whose_child_exits_1_ends_with_an_internal_error_and_is_not_tried_again(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    code = ("import sys; open(sys.argv[1], 'a').write('run\\n'); "
            "print('Traceback (most recent call last):', file=sys.stderr); "
            "print(\"ModuleNotFoundError: No module named 'relaunch.recipes'\", file=sys.stderr); sys.exit(1)")
    child = [sys.executable, "-c", code, str(runs)]
    said: list[tuple[str, str]] = []
    rounds = Rounds(lambda: child, lambda kind, text: said.append((kind, text)))
    assert rounds.start()
    try:
        outcome = wait_for("the round's outcome", rounds.take, timeout=30, every=0.1)
    finally:
        rounds.abort()
    assert outcome.error is not None and outcome.error.exit_code == 1      # an internal error: exit 1
    assert "internal error (exit 1): ModuleNotFoundError: No module named 'relaunch.recipes'" in outcome.error.message
    assert runs.read_text().split() == ["run"]                   # once: no retry
    assert not any("trying again" in text for _, text in said)


def test_a_rounds_child_does_not_import_relaunch_from_the_current_folder() -> None:
    argv = child_argv("recipe.yaml", ["root@10.0.0.9:22"], [])
    assert argv[:4] == [sys.executable, "-P", "-m", "relaunch.cli"]
