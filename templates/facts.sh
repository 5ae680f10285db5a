# relaunch: read-only facts about this instance. Changes nothing.
# Inputs (set above this line by relaunch, shell-quoted): py_want venv ckpt session apt run_info freeze_py name lineage
set -u
echo "home=$HOME"
echo "user=$(id -un)"
echo "uid=$(id -u)"
echo "now=$(date +%s)"
py=""
for c in "python$py_want" python3 python; do
  p=$(command -v "$c" 2>/dev/null) || continue
  v=$("$p" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null) || continue
  case "$v" in "$py_want".*) py=$p; break ;; esac
done
echo "python=$py"
echo "python3_version=$(python3 -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null)"
if [ -n "$py" ] && "$py" -c 'import venv, ensurepip' 2>/dev/null; then echo "venv_module=1"; else echo "venv_module=0"; fi
for t in tmux rsync sha256sum apt-get nvidia-smi; do
  if command -v "$t" >/dev/null 2>&1; then echo "has_$t=1"; else echo "has_$t=0"; fi
done
for pkg in $apt; do
  dpkg -s "$pkg" >/dev/null 2>&1 || echo "missing_apt=$pkg"
done
if [ "$(id -u)" = 0 ] || sudo -n true 2>/dev/null; then echo "can_root=1"; else echo "can_root=0"; fi
free_at() { d=$1; while [ ! -e "$d" ]; do d=$(dirname "$d"); done; df -Pk "$d" | awk 'NR==2 {printf "%.0f\n", $4*1024}'; }
echo "free_ckpt=$(free_at "$ckpt")"
total_at() { d=$1; while [ ! -e "$d" ]; do d=$(dirname "$d"); done; df -Pk "$d" | awk 'NR==2 {printf "%.0f\n", $2*1024}'; }
echo "total_ckpt=$(total_at "$ckpt")"
echo "free_venv=$(free_at "$venv")"
# a path that does not exist yet, whose nearest existing folder this user cannot write in, cannot be
# made (a recipe's /workspace/... on an image where / is root's): preflight says so, before any change
blocked_at() { [ -e "$1" ] && return; d=$1; while [ ! -e "$d" ]; do d=$(dirname "$d"); done; [ -w "$d" ] || echo "$d"; }
echo "ckpt_blocked=$(blocked_at "$ckpt")"
echo "venv_blocked=$(blocked_at "$venv")"
if command -v tmux >/dev/null 2>&1 && tmux has-session -t "=$session" 2>/dev/null; then
  echo "session_alive=1"
  echo "session_since=$(tmux display-message -p -t "=$session:" '#{session_created}' 2>/dev/null)"
else
  echo "session_alive=0"
fi
# A run this login cannot see in its tmux: this recipe's run.sh (how relaunch starts training) in any
# user's process, other users' tmux servers, a checkpoint folder this user cannot look into. Only
# processes of this box count: its mount namespace (a machine of containers, or the sandbox, shows
# other boxes' processes too), told by the id of its root mount: the whole mount table would do but
# for mounts made between two reads of it. The pattern's [.] keeps grep from finding its own command line.
root_mount() { awk '$5 == "/" { print $1; exit }' "$1" 2>/dev/null; }
if [ -n "${name:-}" ]; then
  mnt=$(root_mount /proc/self/mountinfo)
  for f in $(grep -l -s -e "/[.]relaunch/$name/run[.]sh" /proc/[0-9]*/cmdline 2>/dev/null); do
    d=${f%/cmdline}
    case "$(cat "$d/comm" 2>/dev/null)" in tmux*|"") continue ;; esac   # a tmux server keeps its first argv
    [ "$(root_mount "$d/mountinfo")" = "$mnt" ] || continue
    echo "run_process=$(stat -c '%u %U' "$d" 2>/dev/null) ${d#/proc/}"
  done
  for f in $(grep -l -s -x "tmux: server" /proc/[0-9]*/comm 2>/dev/null); do
    d=${f%/comm}
    [ "$(stat -c %u "$d" 2>/dev/null)" != "$(id -u)" ] || continue
    [ "$(root_mount "$d/mountinfo")" = "$mnt" ] || continue
    echo "other_tmux=$(stat -c '%u %U' "$d" 2>/dev/null) ${d#/proc/}"
  done
fi
hidden_at() { d=$1; while [ ! -e "$d" ] && [ "$d" != / ]; do d=$(dirname "$d"); done
  if [ -d "$d" ] && { [ ! -r "$d" ] || [ ! -x "$d" ]; }; then echo "$(stat -c %U "$d" 2>/dev/null) $d"; fi; }
echo "ckpt_hidden=$(hidden_at "$ckpt")"
if command -v nvidia-smi >/dev/null 2>&1; then
  # a broken driver makes nvidia-smi hang for minutes: ask once, briefly
  gpus=$(timeout -k 2 10 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)
  rc=$?
  if [ "$rc" = 0 ]; then
    echo "--- gpus"
    printf '%s\n' "$gpus"
    echo "--- end"
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "gpu_error=nvidia-smi did not answer within 10s"
  else
    echo "gpu_error=nvidia-smi failed (exit $rc): $(printf '%s' "$gpus" | head -n 1)"
  fi
fi
# the branches training started by resuming an older checkpoint (relaunch.train.set_aside)
if [ -n "${lineage:-}" ] && [ -f "$lineage" ]; then
  echo "--- lineage"
  cat -- "$lineage"
  echo
  echo "--- end"
fi
if [ -n "${run_info:-}" ] && [ -f "$run_info" ]; then
  echo "--- run"
  cat -- "$run_info"
  echo
  echo "--- end"
fi
# a venv whose creation was cut short has its python but no activate script (written last): not one;
# nor is one whose python does not run (a Python uv installed where a stop wiped it)
if [ -x "$venv/bin/python" ] && [ -f "$venv/bin/activate" ]; then
  vv=$("$venv/bin/python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null) || vv=""
  echo "venv_python=$vv"
  if [ -n "$vv" ]; then
    echo "--- freeze"
    "$venv/bin/python" -c "$freeze_py" 2>&1
  fi
fi
echo "--- end"
