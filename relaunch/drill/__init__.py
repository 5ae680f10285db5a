"""`relaunch drill`: an interruption rehearsed on real instances, and what it cost, measured.

- by_hand.py     `relaunch drill RECIPE HOST...`: train, copy off, kill (or destroy a sandbox node),
                 evacuate, resume (maybe on fewer nodes), compare the steps run twice
- unattended.py  `relaunch drill RECIPE HOST... --watch`: the real `relaunch watch` left alone while
                 the drill raises a reclaim notice and silences an instance; then goodput
- follow.py      the training logs followed over SSH, each line stamped when it arrived
- timeline.py    from those lines and the watch's history records: time without training, steps
                 lost, goodput and badput over the wall time (pure)
"""

from .by_hand import Drill, run_drill
from .timeline import Measured
from .unattended import run_watched_drill

__all__ = ["Drill", "Measured", "run_drill", "run_watched_drill"]
