# relaunch: the guard of one recipe, run beside its training on the instance (tmux session
# SESSION-guard, started by `relaunch up`). Standard library only; any Python 3 the instance has.
#
# argv: the guard's config file (JSON, written by `relaunch up`; see relaunch/steps/guard.py).
#
# Every `every` seconds it asks each notice source whether the instance is being taken back:
#   aws      IMDSv2: PUT /latest/api/token, then /latest/meta-data/spot/instance-action (404 = no notice)
#   aws-rebalance  IMDSv2 /latest/meta-data/events/recommendations/rebalance: not a notice (AWS: "elevated
#            risk", checkpoint now): recorded in rebalance.json for `relaunch watch`, which copies at once;
#            training goes on and so does the guard
#   gcp      /computeMetadata/v1/instance/preempted with Metadata-Flavor: Google (TRUE / FALSE)
#   azure    /metadata/scheduledevents?api-version=2020-07-01 with Metadata: true (Preempt, Terminate)
#   sigterm  its own SIGTERM (a container or system shutdown)
#   file:P   the file P appears;  url:U  U answers 200 (404 or 204: no notice)
# A source that has not answered as its service does after three looks is switched off and
# said so in state.json (which `relaunch status` shows); one that answered once stays on.
#
# On the first notice it writes notice.json at once, sends the recipe's run.stop signal to the
# training's process group, waits for the training to exit (the save) until the notice's
# deadline or run.stop.timeout, whichever comes first, and writes what happened into
# notice.json. Copying the checkpoint off is not done here: see relaunch/steps/guard.py.
# It exits then, and also when the training ends without a notice, or on SIGHUP/SIGINT
# (`tmux kill-session`, which is how relaunch stops it).
# Under `relaunch run` (the job's own command, training in its foreground) the config has no
# session: the guard only looks and writes notice.json, then exits; relaunch run asks for the save.
#
# One file of one job (the notice), and long on purpose: it runs alone on the instance, with any
# Python 3 there, beside nothing of relaunch.
import calendar
import email.utils
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse

# `relaunch up` and `status` ask once, before anything starts, which sources can fire on this instance:
# RELAUNCH_GUARD_PROBE holds a config of the sources alone, and the script prints what each one did.
PROBE = os.environ.get("RELAUNCH_GUARD_PROBE")
CONFIG = json.loads(PROBE) if PROBE else json.load(open(sys.argv[1]))
FOLDER = CONFIG.get("folder", "")
STATE = os.path.join(FOLDER, "state.json")
NOTICE = os.path.join(FOLDER, "notice.json")
REBALANCE = os.path.join(FOLDER, "rebalance.json")
LOG = os.path.join(FOLDER, "guard.log")
HOST, _, PORT = CONFIG.get("metadata", "169.254.169.254").partition(":")
PORT = int(PORT or 80)
EVERY = float(CONFIG.get("every", 5))
CONNECT_TIMEOUT = 1.0 if PROBE else 2.0     # a probe waits on nothing: `up` is waiting on it
READ_TIMEOUT = 3.0 if PROBE else 5.0
AZURE_FIRST_READ = READ_TIMEOUT if PROBE else 120.0   # Azure documents up to two minutes for the first call
TRIES = 3                     # looks without a proper answer before a source is switched off
# seconds a file: source's file may stay open for writing before it is read as it is (a test's writer waits longer)
WRITING_WAIT = float(CONFIG.get("writing_wait", 10.0))

lock = threading.RLock()
noticed = threading.Event()
leaving = []                  # why the guard stops without a notice (a signal from relaunch)
terms = []                    # SIGTERMs got, for the main loop to turn into the sigterm notice
TICK = 0.1                    # seconds between the main loop's looks at what the handlers recorded
notice = {}
sources_state = {}


def iso(t):
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def write_json(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(data, sort_keys=True) + "\n")
    os.replace(tmp, path)


def log(message):
    with lock, open(LOG, "a") as f:
        f.write(f"{iso(time.time())} {message}\n")


def save_state(**extra):
    with lock:
        state = {"pid": os.getpid(), "started": STARTED, "every": EVERY, "sources": sources_state}
        state.update(extra)
        write_json(STATE, state)


class NoAnswer(Exception):
    """The source did not answer the way its service does."""


def describe(exc):
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


def request(method, path, headers, read_timeout=READ_TIMEOUT, host=HOST, port=PORT, https=False):
    kind = http.client.HTTPSConnection if https else http.client.HTTPConnection
    conn = kind(host, port, timeout=CONNECT_TIMEOUT)   # no proxy: metadata never goes through one
    try:
        conn.connect()
        conn.sock.settimeout(read_timeout)
        conn.request(method, path, headers=headers)
        response = conn.getresponse()
        body = response.read(65536)
        return response.status, {k.lower(): v for k, v in response.getheaders()}, body
    except (OSError, http.client.HTTPException) as exc:
        raise NoAnswer(f"no answer ({describe(exc)})") from None
    finally:
        conn.close()


def parse_when(text):
    """Seconds since the epoch from an ISO 8601 UTC time or an RFC 1123 date; None if neither."""
    text = (text or "").strip()
    for form in ("%Y-%m-%dT%H:%M:%SZ", "%Y-%m-%dT%H:%M:%S.%fZ"):
        try:
            return float(calendar.timegm(time.strptime(text, form)))
        except ValueError:
            pass
    try:
        return email.utils.parsedate_to_datetime(text).timestamp()
    except (TypeError, ValueError, IndexError):
        return None


def from_body(body):
    """A deadline from a file's or URL's content: {"deadline": time} or {"seconds": N} or N."""
    try:
        data = json.loads(body or b"null")
    except ValueError:
        return None
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        return time.time() + float(data)
    if isinstance(data, dict):
        if isinstance(data.get("seconds"), (int, float)):
            return time.time() + float(data["seconds"])
        value = data.get("deadline")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            return parse_when(value)
    return None


class Aws:
    def __init__(self):
        self.token, self.expires = None, 0.0

    def _token(self):
        status, _, body = request("PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "21600"})
        if status != 200 or not body.strip():
            raise NoAnswer(f"the IMDSv2 token PUT answered {status}")
        self.token, self.expires = body.decode().strip(), time.time() + 21600 - 300

    def _get(self, path):
        if self.token is None or time.time() > self.expires:
            self._token()
        status, _, body = request("GET", path, {"X-aws-ec2-metadata-token": self.token})
        if status == 401:       # the token expired or was refused: one new token, once
            self._token()
            status, _, body = request("GET", path, {"X-aws-ec2-metadata-token": self.token})
        if status not in (200, 404):
            raise NoAnswer(f"{path} answered {status}")
        return status, body

    def look(self, first):
        status, body = self._get("/latest/meta-data/spot/instance-action")
        if status == 200:
            try:
                data = json.loads(body)
            except ValueError:
                data = {}
            when = data.get("time", "")
            return {"kind": "instance-action", "detail": "spot {} at {}".format(data.get("action", "?"), when or "?"),
                    "deadline": parse_when(when)}
        return None


class AwsRebalance(Aws):
    """A recommendation, not a notice: it is recorded and the guard goes on (see `advise`)."""

    advice = True

    def look(self, first):
        status, body = self._get("/latest/meta-data/events/recommendations/rebalance")
        if status == 200:
            try:
                when = json.loads(body).get("noticeTime", "")
            except (ValueError, AttributeError):
                when = ""
            return {"kind": "rebalance", "detail": "rebalance recommendation (noticeTime %s)" % (when or "?"),
                    "key": when or body.decode(errors="replace")[:80]}
        return None


class Gcp:
    def look(self, first):
        status, headers, body = request("GET", "/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"})
        if status != 200 or headers.get("metadata-flavor") != "Google":
            raise NoAnswer("instance/preempted answered {}{}".format(
                status, "" if headers.get("metadata-flavor") == "Google" else " without Metadata-Flavor: Google"))
        value = body.strip().upper()
        if value == b"TRUE":
            return {"kind": "preempted", "detail": "instance/preempted is TRUE", "deadline": None}
        if value == b"FALSE":
            return None
        raise NoAnswer(f"instance/preempted answered {body[:40]!r}")


class Azure:
    def look(self, first):
        status, _, body = request("GET", "/metadata/scheduledevents?api-version=2020-07-01", {"Metadata": "true"},
                                  AZURE_FIRST_READ if first else READ_TIMEOUT)
        if status != 200:
            raise NoAnswer(f"scheduledevents answered {status}")
        try:
            events = json.loads(body).get("Events")
        except (ValueError, AttributeError):
            events = None
        if not isinstance(events, list):
            raise NoAnswer("scheduledevents answered without an Events list")
        for event in events:
            if isinstance(event, dict) and event.get("EventType") in ("Preempt", "Terminate"):
                not_before = event.get("NotBefore") or ""
                return {"kind": event["EventType"], "detail": "Scheduled Event {}, NotBefore {}".format(
                    event["EventType"], not_before or "(already started)"), "deadline": parse_when(not_before)}
        return None


def open_for_writing(path):
    """Does a process (one this user may look at) hold `path` open for writing? (/proc/PID/fd, and
    the access mode in /proc/PID/fdinfo/FD)"""
    try:
        want = os.stat(path)
    except OSError:
        return False
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                held = os.stat(f"/proc/{pid}/fd/{fd}")
                if (held.st_dev, held.st_ino) != (want.st_dev, want.st_ino):
                    continue
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    flags = next(int(line.split()[1], 8) for line in f if line.startswith("flags:"))
            except (OSError, StopIteration, ValueError, IndexError):
                continue
            if flags & (os.O_WRONLY | os.O_RDWR):
                return True
    return False


def stat_of(path):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class File:
    def __init__(self, path):
        self.path = path

    def look(self, first):
        if not os.path.exists(self.path):
            return None
        return {"kind": "file", "detail": f"{self.path} appeared", "deadline": from_body(self.written())}

    def written(self):
        """The file's content once whoever writes it is done: a writer that empties the file, then
        writes (`echo '{"seconds": 60}' > P`), shows it empty or half written for a moment, and read
        then, the deadline it states is lost (or another one read: `12` of `120`). Read while no
        process holds it open for writing and it did not change meanwhile; a writer that keeps it
        open longer than WRITING_WAIT does not hold the notice back further."""
        end, said = time.monotonic() + WRITING_WAIT, False
        while True:
            before = stat_of(self.path)
            try:
                with open(self.path, "rb") as f:
                    body = f.read(4096)
            except OSError:
                body = b""
            if (not open_for_writing(self.path) and stat_of(self.path) == before) or time.monotonic() > end:
                return body
            if not said:
                log(f"file:{self.path}: being written; its deadline is read once it is (up to {WRITING_WAIT:g}s)")
                said = True
            time.sleep(0.1)


class Url:
    def __init__(self, url):
        self.url = url
        parts = urllib.parse.urlsplit(url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.https else 80)
        self.path = (parts.path or "/") + ("?" + parts.query if parts.query else "")

    def look(self, first):
        status, _, body = request("GET", self.path, {}, host=self.host, port=self.port, https=self.https)
        if status == 200:
            return {"kind": "url", "detail": f"{self.url} answered 200", "deadline": from_body(body)}
        if status in (204, 404):
            return None
        raise NoAnswer(f"{self.url} answered {status}")


def make_source(name):
    if name == "aws":
        return Aws()
    if name == "aws-rebalance":
        return AwsRebalance()
    if name == "gcp":
        return Gcp()
    if name == "azure":
        return Azure()
    if name.startswith("file:"):
        return File(name[len("file:"):])
    if name.startswith("url:"):
        return Url(name[len("url:"):])
    return None


def notify(name, found):
    with lock:
        if notice:
            return
        seen = time.time()
        window = float(CONFIG["windows"].get(name.split(":", 1)[0], CONFIG["stop_timeout"]))
        deadline = found.get("deadline")
        notice.update({"source": name, "kind": found["kind"], "detail": found["detail"], "seen_at": seen,
                       "seen": iso(seen), "deadline": deadline if deadline else seen + window,
                       "deadline_from": "the notice" if deadline else f"the {name} window of {window:g}s",
                       "save": {"state": "asking"}, "copy": None, "verdict": None, "host": CONFIG["host"]})
    noticed.set()


def advise(name, found):
    """A recommendation (AWS rebalance): rebalance.json, once per recommendation; no stop."""
    with lock:
        seen = time.time()
        write_json(REBALANCE, {"source": name, "kind": found["kind"], "detail": found["detail"], "key": found["key"],
                               "seen_at": seen, "seen": iso(seen), "host": CONFIG["host"]})


def set_source(name, state, why=""):
    with lock:
        sources_state[name] = {"state": state, "why": why, "at": iso(time.time())}
    save_state()


def watch_source(name, source):
    misses, answered, advised = 0, False, None
    while not noticed.is_set() and not leaving:
        try:
            found = source.look(not answered)
        except NoAnswer as exc:
            if not answered:
                misses += 1
                if misses >= TRIES:
                    set_source(name, "off", str(exc))
                    log(f"{name}: off: {exc}")
                    return
        else:
            if not answered:
                answered = True
                set_source(name, "on")
                log(f"{name}: on")
            if found and getattr(source, "advice", False):
                if found["key"] != advised:
                    advised = found["key"]
                    log("{}: recommendation: {}".format(name, found["detail"]))
                    advise(name, found)
            elif found:
                log("{}: notice: {}".format(name, found["detail"]))
                notify(name, found)
                return
        noticed.wait(EVERY)


# The handlers only record: a handler runs in the main thread between two of its bytecodes, and
# notify() sets `noticed`, whose lock the main thread holds for a moment at each entry to and exit
# from noticed.wait(): a SIGTERM landing there would hang the guard for good.
def on_term(signum, frame):
    if "sigterm" in CONFIG["sources"]:
        terms.append(time.time())
    else:
        leaving.append("SIGTERM (sigterm is not one of guard.sources)")


def on_stop(signum, frame):
    leaving.append(f"stopped by relaunch (signal {signum})")


def session_alive(name):
    try:
        return subprocess.run(["tmux", "has-session", "-t", "=" + name], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return True             # cannot tell: never act on that


def read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def start_of(pid):
    """The kernel's start time of a process (field 22 of its stat; the name before it may hold spaces)."""
    text = read(f"/proc/{pid}/stat")
    return text.rsplit(")", 1)[-1].split()[19] if ")" in text else ""


def training_group(session):
    """The training's process group, as relaunch/steps/stop.py's group_script finds it: the group
    run.sh recorded, only while its leader is that same process of this boot; else (a run started by
    hand) the foreground group of the session's tmux pane; None when neither."""
    fields = read(CONFIG["pgid_file"]).split()
    if fields:
        if len(fields) >= 3:
            same = fields[2] == read("/proc/sys/kernel/random/boot_id") and start_of(fields[0]) == fields[1]
            return int(fields[0]) if same and fields[0].isdigit() else None
        return int(fields[0]) if fields[0].isdigit() and session_alive(session) else None
    try:
        pane = subprocess.run(["tmux", "display-message", "-p", "-t", "=" + session + ":", "#{pane_pid}"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        group = subprocess.run(["ps", "-o", "tpgid=", "-p", pane], capture_output=True, text=True,
                               timeout=10).stdout.strip() if pane.isdigit() else ""
    except (OSError, subprocess.SubprocessError):
        return None
    return int(group) if group.isdigit() and group != pane else None


def written_since(folder, since):
    """Whether anything under `folder` was written at `since` or later (this instance's clock): an
    exit status is not a save, a checkpoint written after the notice is."""
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            try:
                if os.lstat(os.path.join(root, name)).st_mtime >= since:
                    return True
            except OSError:
                continue
    return False


def stop_training():
    """run.stop to the training's process group, then wait for it to exit: the save."""
    session, deadline = CONFIG["session"], notice["deadline"]
    if not session_alive(session):
        return {"state": "not running", "detail": "training was not running when the notice came"}
    pgid = training_group(session)
    number = getattr(signal, "SIG" + CONFIG["signal"])
    asked = time.time()
    try:
        if pgid is None:
            raise ValueError("no pgid file of this boot, no command in the tmux pane")
        os.killpg(pgid, number)
    except (ValueError, OSError) as exc:
        return {"state": "not asked", "detail": f"could not signal the training (pgid {pgid!r}): {describe(exc)}"}
    # the deadline, but a few seconds at least (a notice time in the past may be a skewed clock),
    # and never longer than run.stop.timeout
    until = min(max(deadline, asked + 5), asked + float(CONFIG["stop_timeout"]))
    while time.time() < until:
        if not session_alive(session):
            ended = time.time()
            status = read(CONFIG["status_file"])
            state = "exited" if status != "0" else "saved" if "ckpt_dir" not in CONFIG or written_since(
                CONFIG["ckpt_dir"], notice["seen_at"]) else "no save"
            return {"state": state, "exit": status, "signal": CONFIG["signal"],
                    "asked": iso(asked), "ended": iso(ended), "seconds": round(ended - asked, 1),
                    "before_deadline": round(deadline - ended, 1)}
        time.sleep(0.5)
    return {"state": "still running", "signal": CONFIG["signal"], "asked": iso(asked),
            "seconds": round(time.time() - asked, 1), "detail": "training had not exited when the wait ended"}


def main():
    os.makedirs(FOLDER, exist_ok=True)
    for done in (NOTICE, REBALANCE):    # what an earlier guard on this instance saw: kept beside
        if os.path.exists(done):
            stem = os.path.basename(done)[:-len(".json")]
            os.replace(done, os.path.join(FOLDER, f"{stem}-{int(os.path.getmtime(done))}.json"))
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    looking = {name: make_source(name) for name in CONFIG["sources"]}
    for name in looking:
        sources_state[name] = {"state": "on" if name == "sigterm" else "checking", "why": "", "at": STARTED}
    save_state()
    for name, source in looking.items():
        if source is not None:
            threading.Thread(target=watch_source, args=(name, source), daemon=True).start()
    log("started: sources {}, every {:g}s".format(", ".join(CONFIG["sources"]), EVERY))
    gone, next_look = 0, time.monotonic() + min(EVERY, 1.0)
    while not noticed.wait(TICK):
        if terms:
            notify("sigterm", {"kind": "sigterm", "detail": "the guard got SIGTERM (a shutdown)", "deadline": None})
            continue
        if leaving:
            save_state(stopped=leaving[0])
            log(f"stopped: {leaving[0]}")
            return 0
        if time.monotonic() < next_look:
            continue
        next_look = time.monotonic() + min(EVERY, 1.0)
        if not CONFIG["session"]:
            continue            # relaunch run's training: it ends the guard when training ends
        gone = 0 if session_alive(CONFIG["session"]) else gone + 1
        if gone >= 2:
            save_state(stopped="the training ended without a notice")
            log("stopped: the training ended without a notice")
            return 0
    with lock:
        record = dict(notice)
    write_json(NOTICE, record)
    save_state(stopped="after the notice from {}".format(record["source"]))
    if not CONFIG["session"]:
        log("notice from {}: left to relaunch run, which asks the training to save".format(record["source"]))
        return 0
    save = stop_training()
    record["save"] = save
    left = record["deadline"] - time.time()
    record["verdict"] = "training {}; {} before the deadline; copying it off is relaunch's (watch or evacuate)".format(
        {"saved": "saved and exited", "exited": "exited with status {}".format(save.get("exit") or "?"),
         "no save": "exited 0 without saving (nothing in checkpoint.dir written after the notice)",
         "still running": "did not exit in time", "not running": "was not running",
         "not asked": "could not be asked to stop"}[save["state"]],
        (f"{left:.0f}s") if left >= 0 else "NOT")
    write_json(NOTICE, record)
    log("notice from {} handled: {}".format(record["source"], record["verdict"]))
    return 0


# PID 1 decides whether a stop's SIGTERM reaches the guard: an init that ends every process at a
# shutdown does; one that passes signals to its own child only does not reach the tmux sessions
# training and the guard run in; anything else (a container's start script) gets the TERM alone,
# and the SIGKILL that follows ends the rest.
SHUTS_DOWN_ALL = ("systemd", "init", "openrc-init", "runit", "s6-svscan", "my_init")
CHILD_ONLY = ("tini", "dumb-init", "docker-init", "catatonit")


def sigterm_reaches():
    comm = read("/proc/1/comm") or "?"
    if comm in SHUTS_DOWN_ALL:
        return True, f"PID 1 is {comm}: a shutdown sends SIGTERM to every process, the guard's too"
    if comm in CHILD_ONLY:
        return False, (f"PID 1 is {comm}, which passes a stop's SIGTERM to its own child only, not to the tmux "
                       "sessions training and the guard run in")
    return False, (f"PID 1 is {comm}, not an init: a stop's SIGTERM reaches it alone, and the SIGKILL that "
                   "follows ends training unwarned")


def probe_one(name):
    if name == "sigterm":
        fires, why = sigterm_reaches()
        return {"fires": fires, "why": why}
    if name.startswith("file:"):
        return {"fires": None, "why": "fires when {} appears: whatever writes it decides".format(name[len("file:"):])}
    source = make_source(name)
    if source is None:
        return {"fires": False, "why": "not a source this guard knows"}
    try:
        found = source.look(True)
    except NoAnswer as exc:
        return {"fires": False, "why": str(exc)}
    if found and not getattr(source, "advice", False):
        return {"fires": True, "why": "answers, and shows a notice already: {}".format(found["detail"])}
    return {"fires": True, "why": "answers as its service does"}


def probe():
    """One look at every source at once; prints {source: {"fires": true|false|null, "why": ...}}."""
    found = {}
    threads = [threading.Thread(target=lambda n=name: found.__setitem__(n, probe_one(n)), daemon=True)
               for name in CONFIG["sources"]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    print(json.dumps({name: found.get(name, {"fires": False, "why": "no answer within 30s"})
                      for name in CONFIG["sources"]}, sort_keys=True))
    return 0


STARTED = iso(time.time())
sys.exit(probe() if PROBE else main())
