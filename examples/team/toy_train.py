"""A stand-in for a team's trainer, standard library only: counts steps, saves ckpt-<step>.pt
the careful way (write NAME.tmp, then rename), resumes from --resume, and on SIGTERM saves and
exits 0, as `relaunch evacuate --stop` expects."""

import argparse
import json
import os
import signal
import time

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=1000)
parser.add_argument("--save-every", type=int, default=20)
parser.add_argument("--sleep", type=float, default=0.2)
parser.add_argument("--resume", default="")
args = parser.parse_args()

stopping = False


def stop(signum: int, frame: object) -> None:
    global stopping
    stopping = True


def save(step: int) -> None:
    path = os.path.join(args.out, f"ckpt-{step:08d}.pt")
    with open(path + ".tmp", "w") as f:
        json.dump({"step": step, "project": os.environ.get("PROJECT", "")}, f)
    os.replace(path + ".tmp", path)


signal.signal(signal.SIGTERM, stop)
args.out = os.path.expanduser(args.out)
os.makedirs(args.out, exist_ok=True)
step = 0
if args.resume:
    with open(args.resume) as f:
        step = json.load(f)["step"]
    print(f"resumed from {args.resume} at step {step}", flush=True)
print(f"{os.environ.get('TEAM', '')}/{os.environ.get('PROJECT', '')}: training to step {args.steps}", flush=True)
while step < args.steps and not stopping:
    step += 1
    time.sleep(args.sleep)
    print(f"step {step}", flush=True)
    if step % args.save_every == 0:
        save(step)
save(step)
print(f"done step {step}", flush=True)
