"""Run a training script with every rank's DCP shard write held back SLOW_WRITE_SECONDS first.

For tests: a stop or a `kill -9` lands while a Checkpointer's background write is in flight.
The write itself is DCP's own (FileSystemWriter.write_data), only started later.

    python slow_write.py train_dist.py --out ~/ckpt ...      (torchrun runs it as the script)
"""

from __future__ import annotations

import os
import runpy
import sys
import time

from torch.distributed.checkpoint import FileSystemWriter

DELAY = float(os.environ.get("SLOW_WRITE_SECONDS", "5"))
_write_data = FileSystemWriter.write_data


def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
    print(f"slow_write: holding the write of {self.path} for {DELAY:g}s", file=sys.stderr, flush=True)
    time.sleep(DELAY)
    return _write_data(self, plan, planner)


FileSystemWriter.write_data = write_data  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
