# relaunch: watch a training command start. Changes nothing.
# argv: session log status_file ready_regex grace_seconds [step_regex]. Prints one JSON line:
# state "ready" (a log line matched ready_regex), "progressing" (no ready_regex: the step the log
# shows went up, a step above the one on the line before it: a training step ran),
# "alive" (still running after the grace), "finished" (ended with exit 0) or "died" (ended
# otherwise), with the last lines of the log.
import json
import re
import subprocess
import sys
import time

session, log, status_file, ready, grace = sys.argv[1:6]
pattern = re.compile(ready) if ready else None
step_regex = sys.argv[6] if len(sys.argv) > 6 else ""
steps = re.compile(step_regex) if step_regex and not ready else None
end = time.monotonic() + float(grace)
MARK = "=== relaunch: start "


def this_run(whole=False):
    """The lines of the log since the last start; `whole`: without a last one nothing ends yet (the
    training is still writing it: a ready line is read once it is all there)."""
    try:
        with open(log, errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    lines = text[:max(text.rfind("\n"), text.rfind("\r")) + 1].splitlines() if whole else text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(MARK)]
    return lines[starts[-1] + 1:] if starts else lines


def step_went_up(lines):
    """The first line whose step is above the step of the line before it that showed one: one line
    alone (`resumed at step 500`, `saving every step 1000`) proves nothing ran."""
    before = None
    for ln in lines:
        m = steps.search(ln)
        try:
            step = int(m.group(1)) if m else None
        except (IndexError, ValueError):
            step = None
        if step is None:
            continue
        if before is not None and step > before:
            return ln
        before = step
    return None


def alive():
    return subprocess.run(["tmux", "has-session", "-t", "=" + session], capture_output=True).returncode == 0


def status():
    try:
        with open(status_file) as f:
            return f.read().strip()
    except OSError:
        return ""


state, line, started = "alive", "", time.monotonic()
while True:
    lines = this_run(whole=True)
    if pattern:
        found = [ln for ln in lines if pattern.search(ln)]
        if found:
            state, line = "ready", found[0]
            break
    if steps:
        went_up = step_went_up(ln for ln in lines if not ln.startswith("=== relaunch:"))
        if went_up is not None:
            state, line = "progressing", went_up
            break
    if not alive():
        code = status()          # run.sh wrote it before it exited, and the session ended with it
        state = "finished" if code == "0" else "died"
        break
    if time.monotonic() >= end:
        break
    time.sleep(0.5)
print(json.dumps({"state": state, "line": line, "status": status(), "seconds": round(time.monotonic() - started, 1),
                  "tail": [ln for ln in this_run() if not ln.startswith("=== relaunch:")][-20:]}))
