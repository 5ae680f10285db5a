# relaunch: the package indexes this instance's pip and uv are configured with, for `relaunch freeze`.
# Changes nothing. Runs with any python3 (3.8+). argv: VENV. Prints one JSON document:
#   pip_config: `pip config list` of the venv's pip or the system's (None: no pip to ask)
#   pip_files, uv_files: [path, text] of the usual configuration files, lowest precedence first
#   env: the index variables a login shell on this instance exports (~/.profile, /etc/environment)
import json
import os
import subprocess
import sys

NAMES = ["PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "UV_INDEX_URL", "UV_EXTRA_INDEX_URL", "UV_INDEX", "UV_DEFAULT_INDEX"]
venv = sys.argv[1]
home = os.path.expanduser("~")
config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")


def run(argv, timeout=60):
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              timeout=timeout, env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.decode("utf-8", "replace") if done.returncode == 0 else None


def pip_config():
    """pip's own view: every file it reads (PIP_CONFIG_FILE too), merged as it merges them."""
    for python in (os.path.join(venv, "bin", "python"), "python3"):
        if run([python, "-m", "pip", "--version"]) is not None:
            return run([python, "-m", "pip", "config", "list"])
    return None


def files(paths):
    found = []
    for path in paths:
        if path and os.path.isfile(path):
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    found.append([path, f.read(65536)])
            except OSError:
                pass
    return found


def login_env():
    script = ('for v in "$@"; do eval "x=\\${$v-}"; if [ -n "$x" ]; then printf "relaunch-env %s=%s\\n" "$v" "$x"; '
              "fi; done")
    out = run(["bash", "-lc", script, "bash", *NAMES]) or ""
    found = {}
    for line in out.splitlines():
        if line.startswith("relaunch-env "):
            name, _, value = line[len("relaunch-env "):].partition("=")
            if name in NAMES:
                found[name] = value
    return found


print(json.dumps({
    "pip_config": pip_config(),
    "pip_files": files(["/etc/xdg/pip/pip.conf", "/etc/pip.conf", os.path.join(home, ".pip", "pip.conf"),
                        os.path.join(config, "pip", "pip.conf"), os.path.join(venv, "pip.conf"),
                        os.environ.get("PIP_CONFIG_FILE", "")]),
    "uv_files": files(["/etc/uv/uv.toml", os.path.join(config, "uv", "uv.toml")]),
    "env": login_env(),
}))
