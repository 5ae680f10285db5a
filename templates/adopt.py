# relaunch adopt: read-only facts about a training run that was started by hand.
#
# `relaunch adopt` runs this on the instance as `python3 -I -S -B -c THIS MODE PARAMS` (isolated,
# no site, no bytecode written) and reads the one JSON document it prints. It changes nothing:
# it reads /proc and files and lists folders; it asks tmux only through a server socket that
# already exists (list-panes, show-environment, capture-pane -p: queries, no client attaches,
# no buffer is made) and nvidia-smi only queries (bounded). No other program runs.
#
# Modes: `scan` (every process, session and GPU, to find the training) and `detail` (one
# process: its environment against its session's, its venv's packages, the files its command
# names, folders that hold checkpoints, its last output lines).
#
# Secrets: the value of an environment variable that looks secret (by its name, or by its shape:
# a URL with credentials, a known token prefix, a long token-like string) never leaves this
# script. Wherever such a value appears (a command line, a tmux start command, an output line)
# it is replaced by NUL NAME NUL; a file that holds one is not sent. Standard library only,
# Python 3.6 and later.
#
# One file of one job (read-only facts), and long on purpose: it is sent alone, as `-c THIS`, to an
# instance that has nothing of relaunch.
import json
import os
import re
import stat
import subprocess
import sys
import urllib.parse

ME = os.getpid()
TEXT_LIMIT = 256 * 1024          # a file larger than this is not a "small text file"
SOURCES_LIMIT = 300              # .py files read under an import root
SOURCES_BYTES = 4 * 1024 * 1024
WALK_LIMIT = 50000               # entries a folder scan visits at most

SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW(OR)?D|PASSPHRASE|(^|_)PASS($|_)|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|"
                         r"(^|_)KEY($|_)|CREDENTIAL|(^|_)AUTH|COOKIE|SESSION_?ID|WEBHOOK|(^|_)DSN($|_)",
                         re.IGNORECASE)
NOT_SECRET = {"SSH_AUTH_SOCK", "SSH_AGENT_PID", "XAUTHORITY", "KRB5CCNAME", "GPG_AGENT_INFO",
              "TOKENIZERS_PARALLELISM", "HF_HUB_DISABLE_IMPLICIT_TOKEN"}
NO_SHAPE_CHECK = re.compile(r"^(CUDA_|NVIDIA_|NCCL_|LS_COLORS$|PATH$|LD_LIBRARY_PATH$|PYTHONPATH$|MANPATH$|"
                            r"INFOPATH$|TERMCAP$|PS1$|PROMPT_COMMAND$|BASH_FUNC_)")
TOKEN_PREFIX = re.compile(r"^(hf_|sk-|sk_|ghp_|gho_|ghs_|ghu_|github_pat_|glpat-|xox[abposr]-|AKIA[0-9A-Z]{12}|"
                          r"ASIA[0-9A-Z]{12}|AIza|ya29\.|eyJ)[A-Za-z0-9_.=+/-]{8,}$")
TOKEN_LIKE = re.compile(r"^[A-Za-z0-9_+=/.-]{32,}$")
# a URL's credentials, as relaunch/ui.py finds them (a test checks that both agree): its userinfo, a
# token-like path segment (`https://dl.cloudsmith.io/<token>/org/repo/python/simple/`), the value of
# a query parameter named like a credential (`?token=`, `X-Amz-Signature=`, `sig=`)
URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
URL_PARTS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#\s]*@)?(?P<host>[^/?#\s@]*)"
                       r"(?P<path>[^?#\s]*)(?P<rest>.*)", re.DOTALL)
SECRET_PARAM = re.compile(r".*(token|secret|passw(or)?d|signature|credential|auth|authorization)|"
                          r"sig|key|apikey|api[-_]key|access[-_]?key|private[-_]?key|.*_key|pass|pwd|code",
                          re.IGNORECASE)
PARAM = re.compile(r"([?&;#])([^=&;#\s]+)=([^&;#\s]*)")
ASSIGNMENT = re.compile(r"(?<![^\s;&|(`'\"])([A-Za-z_][A-Za-z0-9_]*)=(\"[^\"]*\"|'[^']*'|[^\s;&|'\"]+)")
PYTHON_EXE = re.compile(r"^(python|pypy)[0-9.]*$")
CKPT_FILE = re.compile(r".*\d.*\.(pt|pth|ckpt|bin|safetensors|tar|pkl|npz|h5|msgpack|distcp)$|^last\.ckpt$|^last\.pt$")
CKPT_DIR = re.compile(r"^(checkpoint-\d+|checkpoint_\d+|global_step\d+|step[-_]?\d+|epoch[-_=]?\d+.*|iter[-_]?\d+)$")
SKIP_DIRS = {"__pycache__", "node_modules", "site-packages", "dist-packages", ".git", "wandb"}

secrets = {}                    # value -> the name it was found under
secret_names = set()


# -- secrets ---------------------------------------------------------------------------------
def secret_name(name):
    return name not in NOT_SECRET and not name.startswith("TOKENIZERS_") and bool(SECRET_NAME.search(name))


def token_segment(segment):
    """16 or more of [A-Za-z0-9_-] whose letters and digits change case or kind often (ui._token_like)."""
    if len(segment) < 16 or not re.match(r"^[A-Za-z0-9_-]+$", segment):
        return False

    def kind(c):
        return "d" if c.isdigit() else "u" if c.isupper() else "l"

    pairs = [(segment[i - 1], segment[i]) for i in range(1, len(segment))]
    changes = sum(1 for a, b in pairs if a.isalnum() and b.isalnum() and kind(a) != kind(b))
    return changes >= len(segment) / 4


def secret_param(name):
    return bool(SECRET_PARAM.fullmatch(urllib.parse.unquote(name)))


def url_scrub(url):
    """The URL with each credential replaced by the marker of URL_CREDENTIALS."""
    m = URL_PARTS.fullmatch(url)
    if m is None:
        return url
    hidden = marker("URL_CREDENTIALS")
    path = "/".join(hidden if token_segment(seg) else seg for seg in m.group("path").split("/"))

    def param(p):
        return p.group(1) + p.group(2) + "=" + hidden if p.group(3) and secret_param(p.group(2)) else p.group(0)

    return (m.group("scheme") + (hidden + "@" if m.group("userinfo") else "") + m.group("host") + path
            + PARAM.sub(param, m.group("rest")))


def url_has_credentials(text):
    return any(url_scrub(u) != u for u in URL.findall(text))


def secret_shape(value):
    value = value.strip()
    return bool(url_has_credentials(value) or TOKEN_PREFIX.match(value) or
                (TOKEN_LIKE.match(value) and re.search(r"[0-9]", value) and re.search(r"[A-Za-z]", value)
                 and not value.startswith(("/", "."))))


def is_secret(name, value):
    if secret_name(name):
        return True
    return bool(value) and not NO_SHAPE_CHECK.match(name) and secret_shape(value)


def note_env(env):
    for name, value in env.items():
        if is_secret(name, value):
            secret_names.add(name)
            if len(value) >= 4 and value not in secrets:
                secrets[value] = name


def marker(name):
    return "\0" + name + "\0"


def flag_env_name(flag):
    name = re.sub(r"[^A-Za-z0-9_]", "_", flag.lstrip("-")).upper()
    return name if re.match(r"^[A-Za-z_]", name) else "SECRET_" + name


def scrub(text):
    """`text` with every known secret value, secret assignment and URL credential replaced."""
    if not text:
        return text
    for value in sorted(secrets, key=len, reverse=True):
        if value in text:
            text = text.replace(value, marker(secrets[value]))

    def assignment(m):
        if secret_name(m.group(1)) and "\0" not in m.group(2):
            return m.group(1) + "=" + marker(m.group(1))
        return m.group(0)

    text = ASSIGNMENT.sub(assignment, text)
    return URL.sub(lambda m: url_scrub(m.group(0)), text)


def scrub_argv(argv):
    out = []
    secret_flag = None
    for arg in argv:
        if secret_flag is not None and not arg.startswith("-"):
            out.append(marker(secrets.get(arg, flag_env_name(secret_flag))))
            secret_flag = None
            continue
        secret_flag = None
        if arg.startswith("-") and secret_name(flag_env_name(arg.split("=", 1)[0])):
            if "=" in arg:
                flag, value = arg.split("=", 1)
                out.append(flag + "=" + marker(secrets.get(value, flag_env_name(flag))) if value else arg)
                continue
            secret_flag = arg
        elif TOKEN_PREFIX.match(arg):
            out.append(marker(secrets.get(arg, "SECRET_ARG")))
            continue
        out.append(scrub(arg))
    return out


def holds_secret(text):
    return [secrets[v] for v in secrets if len(v) >= 6 and v in text]


# -- small readers ---------------------------------------------------------------------------
def read_bytes(path, limit=1 << 20):
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except (OSError, ValueError):
        return None


def read_text(path, limit=1 << 20):
    data = read_bytes(path, limit)
    return None if data is None else data.decode("utf-8", "replace")


def link(path):
    try:
        return os.readlink(path)
    except OSError:
        return None


def run(argv, timeout=10):
    """(exit status, stdout text, stderr text); status None when it did not finish in time."""
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as exc:
        return 127, "", str(exc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None, "", f"did not answer within {timeout}s"
    return proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def which(name):
    for folder in os.environ.get("PATH", "/usr/bin:/bin").split(":"):
        path = os.path.join(folder or ".", name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def environ(pid):
    data = read_bytes(f"/proc/{pid}/environ", 4 << 20)
    if data is None:
        return None
    env = {}
    for item in data.split(b"\0"):
        if b"=" in item:
            name, _, value = item.partition(b"=")
            env[name.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


def argv_of(pid):
    data = read_bytes(f"/proc/{pid}/cmdline", 1 << 20)
    if not data:
        return []
    return [a.decode("utf-8", "replace") for a in data.rstrip(b"\0").split(b"\0")]


def parse_env_lines(text):
    env = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("-"):
            name, _, value = line.partition("=")
            env[name] = value
    return env


# -- processes -------------------------------------------------------------------------------
def boot_time():
    for line in (read_text("/proc/stat") or "").splitlines():
        if line.startswith("btime "):
            return int(line.split()[1])
    return 0


BTIME = boot_time()
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
MY_MNT = link("/proc/self/ns/mnt")


def stat_of(pid):
    text = read_text(f"/proc/{pid}/stat")
    if not text or ")" not in text:
        return None
    comm = text[text.index("(") + 1:text.rindex(")")]
    rest = text[text.rindex(")") + 2:].split()
    return {"comm": comm, "state": rest[0], "ppid": int(rest[1]), "pgrp": int(rest[2]), "sid": int(rest[3]),
            "start": BTIME + int(rest[19]) / float(TICKS)}


def uid_of(pid):
    for line in (read_text(f"/proc/{pid}/status") or "").splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    return -1


def user_name(uid):
    for line in (read_text("/etc/passwd") or "").splitlines():
        fields = line.split(":")
        if len(fields) > 2 and fields[2] == str(uid):
            return fields[0]
    return str(uid)


def all_processes():
    """Every process in this mount namespace that can be read (sandboxes and containers share
    the PID namespace with others; a path means what it says only in the same mount namespace)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        if link(f"/proc/{pid}/ns/mnt") != MY_MNT:
            continue
        info = stat_of(pid)
        if info is None:
            continue
        info["pid"] = pid
        found[pid] = info
    return found


def site_prefixes(pid):
    """The environment roots whose site-packages the process has mapped (compiled packages)."""
    prefixes = set()
    for line in (read_text(f"/proc/{pid}/maps", 8 << 20) or "").splitlines():
        path = line.split(None, 5)[-1] if line.count(" ") >= 5 else ""
        m = re.match(r"^(/.*?)/lib(64)?/python[0-9.]+/site-packages/", path)
        if m:
            prefixes.add(m.group(1))
    return sorted(prefixes)


def resolve_argv0(argv0, cwd, env):
    if not argv0:
        return None
    if "/" in argv0:
        return os.path.normpath(os.path.join(cwd or "/", argv0))
    for folder in (env or {}).get("PATH", "").split(":"):
        path = os.path.join(os.path.join(cwd or "/", folder) if folder else (cwd or "/"), argv0)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return os.path.normpath(path)
    return None


def env_root(path):
    """The venv or conda env a bin/python path belongs to ("" if none)."""
    if not path:
        return ""
    root = os.path.dirname(os.path.dirname(path))
    if os.path.isfile(os.path.join(root, "pyvenv.cfg")) or os.path.isdir(os.path.join(root, "conda-meta")):
        return root
    return ""


def fds(pid):
    nvidia, targets = [], {}
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None, {}
    for fd in names:
        target = link(f"/proc/{pid}/fd/{fd}")
        if target is None:
            continue
        if fd in ("1", "2"):
            targets[fd] = target
        if re.match(r"^/dev/nvidia\d+$", target) and target not in nvidia:
            nvidia.append(target)
    return sorted(nvidia), targets


def is_python(pid, info):
    exe = link(f"/proc/{pid}/exe")
    if exe is None or not PYTHON_EXE.match(os.path.basename(exe).replace(" (deleted)", "")):
        return False
    info["exe"] = exe
    return True


def python_facts(pid, info, root):
    """What a Python process shows; the costly reads (its environment, mapped files) for a
    process with no Python above it only: workers and data loaders are many, and alike."""
    argv = argv_of(pid)
    nvidia, targets = fds(pid)
    info.update({"python": True, "nvidia": nvidia, "fd1": targets.get("1", ""), "fd2": targets.get("2", ""),
                 "_argv": argv, "cwd": link(f"/proc/{pid}/cwd")})
    if not root:
        return
    env = environ(pid) or {}
    note_env(env)
    argv0 = resolve_argv0(argv[0] if argv else "", info["cwd"], env)
    info.update({"argv0": argv0, "argv0_root": env_root(argv0), "virtual_env": env.get("VIRTUAL_ENV", ""),
                 "conda_prefix": env.get("CONDA_PREFIX", ""), "mapped": site_prefixes(pid),
                 "home": env.get("HOME", "")})


# -- sessions --------------------------------------------------------------------------------
def tmux_sockets():
    """Sockets of tmux servers that exist: never a path tmux would create (it makes its folder
    when asked without -S)."""
    uid = os.getuid()
    base = os.environ.get("TMUX_TMPDIR") or "/tmp"
    folders = []
    try:
        names = os.listdir(base)
    except OSError:
        names = []
    for name in sorted(names):
        if name == f"tmux-{uid}" or (uid == 0 and name.startswith("tmux-")):
            folders.append(os.path.join(base, name))
    sockets = []
    for folder in folders:
        try:
            entries = sorted(os.listdir(folder))
        except OSError:
            continue
        for entry in entries:
            path = os.path.join(folder, entry)
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    sockets.append(path)
            except OSError:
                pass
    return sockets


PANE_FORMAT = "\t".join(["#{session_name}", "#{session_created}", "#{window_index}", "#{pane_index}", "#{pane_id}",
                         "#{pane_pid}", "#{pane_dead}", "#{pane_current_path}", "#{pane_start_command}"])


def tmux(socket, *args):
    binary = which("tmux")
    if binary is None:
        return 127, "", "tmux is not installed"
    return run([binary, "-S", socket] + list(args), timeout=10)


def tmux_servers():
    servers = []
    for socket in tmux_sockets():
        status, out, err = tmux(socket, "list-panes", "-a", "-F", PANE_FORMAT)
        server = {"socket": socket, "panes": [], "error": "" if status == 0 else (err.strip() or f"exit {status}")}
        if status == 0:
            _, genv, _ = tmux(socket, "show-environment", "-g")
            note_env(parse_env_lines(genv))
            seen = set()
            for line in out.splitlines():
                parts = line.split("\t", 8)
                if len(parts) < 9:
                    continue
                session = parts[0]
                if session not in seen:
                    seen.add(session)
                    _, senv, _ = tmux(socket, "show-environment", "-t", "=" + session)
                    note_env(parse_env_lines(senv))
                server["panes"].append({
                    "session": session, "created": int(parts[1]) if parts[1].isdigit() else 0,
                    "window": parts[2], "pane": parts[3], "id": parts[4],
                    "pid": int(parts[5]) if parts[5].isdigit() else 0, "dead": parts[6] == "1",
                    "path": parts[7], "_start": parts[8]})
        servers.append(server)
    return servers


def screen_sessions():
    """screen's sessions, from its socket folders (`PID.NAME`): no screen command runs."""
    uid = os.getuid()
    folders = [os.environ.get("SCREENDIR", "")]
    for base in ("/run/screen", "/var/run/screen"):
        try:
            names = sorted(os.listdir(base))
        except OSError:
            continue
        me = user_name(uid)
        folders += [os.path.join(base, n) for n in names if n == "S-" + me or uid == 0]
    folders.append(os.path.join(os.environ.get("HOME", "/"), ".screen"))
    found, seen = [], set()
    for folder in folders:
        if not folder or folder in seen:
            continue
        seen.add(folder)
        try:
            entries = sorted(os.listdir(folder))
        except OSError:
            continue
        for entry in entries:
            m = re.match(r"^(\d+)\.(.+)$", entry)
            if m:
                found.append({"pid": int(m.group(1)), "name": m.group(2), "id": entry, "folder": folder})
    return found


# -- GPUs ------------------------------------------------------------------------------------
def gpus():
    binary = which("nvidia-smi")
    if binary is None:
        return {"smi": False, "error": "", "list": [], "apps": []}
    status, out, err = run([binary, "--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader"])
    if status != 0:
        said = (err or out).strip().splitlines()
        why = said[-1] if said else ("did not answer within 10s" if status is None else f"exit {status}")
        return {"smi": True, "error": why, "list": [], "apps": []}
    listed = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4:
            listed.append({"index": parts[0], "uuid": parts[1], "name": parts[2], "memory": parts[3]})
    status, out, _ = run([binary, "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader"])
    apps = []
    for line in out.splitlines() if status == 0 else []:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit():
            apps.append({"pid": int(parts[0]), "uuid": parts[1], "memory": parts[2] if len(parts) > 2 else ""})
    return {"smi": True, "error": "", "list": listed, "apps": apps}


def dmi():
    out = {}
    for key in ("sys_vendor", "product_name", "bios_vendor", "board_vendor", "chassis_asset_tag"):
        text = read_text("/sys/class/dmi/id/" + key, 4096)
        out[key] = text.strip() if text else ""
    return out


# -- scan ------------------------------------------------------------------------------------
def scan():
    procs = all_processes()
    mine = set()
    pid = ME
    while pid in procs and pid > 1:          # this script and the shells that started it
        mine.add(pid)
        pid = procs[pid]["ppid"]
    note_env(dict(os.environ))
    pythons = [p for p in procs if p not in mine and is_python(p, procs[p])]
    python_set = set(pythons)
    for p in pythons:
        q, root = procs[p]["ppid"], True
        while q in procs and q > 1:
            if q in python_set:
                root = False
                break
            q = procs[q]["ppid"]
        python_facts(p, procs[p], root)
    servers = tmux_servers()
    screens = screen_sessions()
    keep = set(pythons)
    for p in pythons:                        # the chain above each python process: its session
        q = procs[p]["ppid"]
        while q in procs and q not in keep and q > 1:
            keep.add(q)
            q = procs[q]["ppid"]
    for server in servers:
        keep.update(pane["pid"] for pane in server["panes"])
    keep.update(s["pid"] for s in screens)
    for p in keep:
        if p in procs:
            note_env(environ(p) or {})
            procs[p]["uid"] = uid_of(p)
    for p in keep:
        if p in procs:
            procs[p]["argv"] = scrub_argv(procs[p].pop("_argv", None) or argv_of(p))
    for server in servers:
        for pane in server["panes"]:
            pane["start"] = scrub(pane.pop("_start"))
    users = {}
    listed = []
    for p, info in sorted(procs.items()):
        info.pop("_argv", None)
        if p in keep:
            uid = info.get("uid", -1)
            if uid not in users:
                users[uid] = user_name(uid)
            info["user"] = users[uid]
            listed.append(info)
        else:
            listed.append({"pid": p, "ppid": info["ppid"], "comm": info["comm"]})
    uid = os.getuid()
    return {"self": ME, "mine": sorted(mine), "uid": uid, "user": user_name(uid),
            "home": os.environ.get("HOME", ""), "hostname": (read_text("/proc/sys/kernel/hostname") or "").strip(),
            "login_env": sorted(os.environ), "dmi": dmi(), "procs": listed, "tmux": servers, "screen": screens,
            "gpus": gpus(), "secret_names": sorted(secret_names)}


# -- detail ----------------------------------------------------------------------------------
def baseline(base):
    kind = base.get("kind")
    if kind == "tmux":
        _, genv, _ = tmux(base["socket"], "show-environment", "-g")
        env = parse_env_lines(genv)
        _, senv, _ = tmux(base["socket"], "show-environment", "-t", "=" + base["session"])
        for line in senv.splitlines():
            if line.startswith("-"):
                env.pop(line[1:], None)
            elif "=" in line:
                name, _, value = line.partition("=")
                env[name] = value
        return env
    if kind in ("screen", "parent"):
        return environ(int(base["pid"])) or {}
    return dict(os.environ)


def classify_env(env, base):
    out = []
    for name in sorted(env):
        value = env[name]
        secret = is_secret(name, value)
        out.append({"name": name, "secret": secret, "value": None if secret else scrub(value),
                    "in_base": name in base, "same": base.get(name) == value})
    return out


def text_of(path):
    """(text, why not) of a small text file."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return None, exc.strerror or "unreadable"
    if st.st_size > TEXT_LIMIT:
        return None, f"larger than {TEXT_LIMIT // 1024} KiB"
    data = read_bytes(path, TEXT_LIMIT + 1)
    if data is None:
        return None, "unreadable"
    if b"\0" in data:
        return None, "binary"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    held = holds_secret(text)
    if held:
        return None, "holds the value of " + ", ".join(sorted(set(held)))
    return text, ""


def describe(path):
    try:
        st = os.stat(path)
    except OSError:
        return {"path": path, "kind": "missing"}
    if stat.S_ISDIR(st.st_mode):
        return {"path": path, "kind": "d", "size": 0}
    if not stat.S_ISREG(st.st_mode):
        return {"path": path, "kind": "other", "size": 0}
    text, why = text_of(path)
    return {"path": path, "kind": "f", "size": st.st_size, "text": text, "why": why}


def is_env_dir(path, names):
    return "pyvenv.cfg" in names or "conda-meta" in names or os.path.basename(path) in SKIP_DIRS


def walk(root, depth):
    """(folder, names) below root, depth-bounded, skipping hidden folders, venvs and caches."""
    visited = 0
    stack = [(root, 0)]
    while stack:
        folder, level = stack.pop()
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        visited += len(names)
        if visited > WALK_LIMIT:
            return
        yield folder, names
        if level >= depth:
            continue
        for name in reversed(names):
            path = os.path.join(folder, name)
            if name.startswith(".") or name in SKIP_DIRS:
                continue
            try:
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    continue
                children = os.listdir(path)
            except OSError:
                continue
            if not is_env_dir(path, children):
                stack.append((path, level + 1))


def sources(roots):
    found, total = [], 0
    for root in roots:
        for folder, names in walk(root, 4):
            for name in names:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                if len(found) >= SOURCES_LIMIT or total > SOURCES_BYTES:
                    return found, True
                text, why = text_of(path)
                found.append({"path": path, "text": text, "why": why})
                total += len(text or "")
    return found, False


def checkpoint_folders(roots):
    """Folders that directly hold checkpoint-looking things, with how many and the newest mtime."""
    found = {}
    for root, depth in roots:
        for folder, names in walk(root, depth):
            hits, newest, sample = 0, 0.0, []
            for name in names:
                path = os.path.join(folder, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                looks = (stat.S_ISDIR(st.st_mode) and (CKPT_DIR.match(name) or name.endswith(".ckpt"))) or \
                    (stat.S_ISREG(st.st_mode) and CKPT_FILE.match(name))
                if not looks:
                    continue
                hits += 1
                newest = max(newest, st.st_mtime)
                if len(sample) < 5:
                    sample.append(name)
            if hits and folder not in found:
                found[folder] = {"dir": folder, "hits": hits, "newest": newest, "sample": sample}
    return sorted(found.values(), key=lambda f: f["dir"])


def dist_info(site):
    dists = []
    try:
        names = sorted(os.listdir(site))
    except OSError:
        return dists
    for name in names:
        if name.endswith(".dist-info"):
            meta = read_text(os.path.join(site, name, "METADATA"), 256 * 1024) or ""
        elif name.endswith(".egg-info"):
            path = os.path.join(site, name)
            meta = read_text(os.path.join(path, "PKG-INFO") if os.path.isdir(path) else path, 256 * 1024) or ""
        else:
            continue
        fields, requires = {}, []
        for line in meta.splitlines():
            if not line.strip():
                break
            key, sep, value = line.partition(":")
            if sep and key in ("Name", "Version") and key not in fields:
                fields[key] = value.strip()
            elif sep and key == "Requires-Dist":
                requires.append(value.strip())
        if "Name" not in fields or "Version" not in fields:
            continue
        # the import names it provides (for "does the program import this package itself?")
        top_text = read_text(os.path.join(site, name, "top_level.txt"), 16 * 1024) if name.endswith(".dist-info") \
            else None
        top = [t.strip() for t in (top_text or "").splitlines() if t.strip()][:50]
        direct = None
        raw = read_text(os.path.join(site, name, "direct_url.json"), 64 * 1024) if name.endswith(".dist-info") \
            else None
        if raw:
            try:
                direct = json.loads(scrub(raw))
            except ValueError:
                direct = None
        dists.append({"name": fields["Name"], "version": fields["Version"], "direct": direct, "requires": requires,
                      "top": top})
    return dists


def environment_root(root, extra_sites=()):
    """The venv (or conda env) at root, or (no root) the site folders pip installs into."""
    if not root and not extra_sites:
        return None
    cfg = read_text(os.path.join(root, "pyvenv.cfg"), 64 * 1024) if root else None
    pyvenv = {}
    for line in (cfg or "").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            pyvenv[key.strip()] = scrub(value.strip())
    sites = [s for s in extra_sites if os.path.isdir(s)]
    for lib in ("lib", "lib64") if root else ():
        try:
            names = sorted(os.listdir(os.path.join(root, lib)))
        except OSError:
            continue
        for name in names:
            site = os.path.join(root, lib, name, "site-packages")
            if re.match(r"^python\d+\.\d+$", name) and os.path.isdir(site) and \
                    os.path.realpath(site) not in [os.path.realpath(s) for s in sites]:
                sites.append(site)
    dists, seen = [], set()
    for site in sites:
        for dist in dist_info(site):
            key = dist["name"].lower().replace("_", "-")
            if key not in seen:
                seen.add(key)
                dists.append(dist)
    return {"path": root, "exists": bool(root) and os.path.isdir(root), "pyvenv": pyvenv if cfg is not None else None,
            "conda": bool(root) and os.path.isdir(os.path.join(root, "conda-meta")), "site": sites, "dists": dists}


PIP_CONFIGS = ["{prefix}/pip.conf", "{home}/.config/pip/pip.conf", "{home}/.pip/pip.conf", "/etc/pip.conf",
               "/etc/xdg/pip/pip.conf", "{home}/.config/uv/uv.toml", "/etc/uv/uv.toml"]


def pip_config(prefix, home, env):
    found = []
    paths = [p.format(prefix=prefix or "/nonexistent", home=home or "/nonexistent") for p in PIP_CONFIGS]
    if env.get("PIP_CONFIG_FILE"):
        paths.insert(0, env["PIP_CONFIG_FILE"])
    for path in paths:
        text = read_text(path, 64 * 1024)
        if text is not None:
            found.append({"path": path, "text": scrub(text)})
    return found


def output_lines(pane, log):
    if pane:
        status, out, _ = tmux(pane["socket"], "capture-pane", "-p", "-J", "-S", "-40", "-t", pane["id"])
        if status == 0:
            return "tmux capture-pane", [scrub(line) for line in out.rstrip("\n").splitlines()][-40:]
    if log:
        data = read_bytes(log, 64 << 20) or b""
        lines = data[-65536:].decode("utf-8", "replace").splitlines()[-40:]
        return log, [scrub(line) for line in lines]
    return "", []


def detail(params):
    pid = int(params["pid"])
    note_env(dict(os.environ))
    env = environ(pid) or {}
    note_env(env)
    for other in params.get("related", []):
        note_env(environ(int(other)) or {})
    base = baseline(params.get("base") or {})
    note_env(base)
    if (params.get("base") or {}).get("kind") == "tmux":
        tmux_servers()                       # the other sessions' secrets too, for scrubbing
    prefix = params.get("prefix", "")
    home = params.get("home", "")
    found, capped = sources(params.get("import_roots", []))
    origin, lines = output_lines(params.get("pane"), params.get("log"))
    roots = [(r, 4) for r in params.get("named_dirs", [])] + [(r, int(d)) for r, d in params.get("scan_roots", [])]
    return {"pid": pid, "alive": os.path.isdir(f"/proc/{pid}"), "env": classify_env(env, base),
            "base_kind": (params.get("base") or {}).get("kind", "login"),
            "prefix": environment_root(prefix, params.get("sites", [])), "pip_config": pip_config(prefix, home, env),
            "paths": [describe(p) for p in params.get("paths", [])], "sources": found, "sources_capped": capped,
            "checkpoint_folders": checkpoint_folders(roots), "output": {"from": origin, "lines": lines},
            "secret_names": sorted(secret_names)}


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "scan"
    result = scan() if mode == "scan" else detail(json.loads(sys.argv[2]))
    sys.stdout.write(json.dumps(result))
    sys.stdout.write("\n")
