"""`relaunch drill`: an interruption rehearsed on real instances, and what it cost, measured.

- by_hand.py     `relaunch drill RECIPE HOST...`: train, copy off, kill (or destroy a sandbox node),
                 evacuate, resume (maybe on fewer nodes), compare the steps run twice
"""

from .by_hand import Drill, run_drill

__all__ = ["Drill", "run_drill"]
