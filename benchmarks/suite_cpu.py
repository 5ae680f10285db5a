"""Where the test suite's CPU goes: run a command (default: the suite, as CI runs it) with the
kernel's process accounting on, and print the CPU seconds of each kind of process it started.

    sudo python benchmarks/suite_cpu.py                              # python -m pytest
    sudo python benchmarks/suite_cpu.py -- python -m pytest tests/test_world.py -n 2

Every process that ends while the command runs is counted, with the command line it ran (from the
kernel's exec events): `relaunch up`, `python train.py`, `uv`, `ssh` ... A process that never ran
a program of its own (a fork) counts under its parent's name in brackets. Accounting is the whole
machine's: run it on a machine that does nothing else. The suite on 2 cores is CPU-bound (vmstat:
idle under 15% through a run), so its time is its CPU seconds over the cores: this table is where a
shorter run has to come from. Needs root (acct(2) and the proc connector), as the suite does.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from relaunch.sandbox.processes import cmdline

# struct acct_v3 (linux/acct.h): 64 bytes; the times are comp_t in AHZ (100) ticks
ACCT_V3 = struct.Struct("=BBHIIIIIIfHHHHHHHH16s")
AHZ = 100
# the proc connector (linux/cn_proc.h)
NETLINK_CONNECTOR, CN_IDX_PROC, CN_VAL_PROC = 11, 1, 1
PROC_CN_MCAST_LISTEN, PROC_EVENT_EXEC = 1, 0x00000002


def comp_t(value: int) -> int:
    """13-bit mantissa, 3-bit base-8 exponent."""
    return (value & 0x1FFF) << (3 * (value >> 13))


class Execs(threading.Thread):
    """Every exec on the machine: (time, pid) -> its command line, read from /proc at once."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.seen: dict[int, list[tuple[float, str]]] = collections.defaultdict(list)
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.bind((0, CN_IDX_PROC))
        op = struct.pack("=I", PROC_CN_MCAST_LISTEN)
        cn_msg = struct.pack("=IIIIHH", CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(op), 0) + op
        self.sock.send(struct.pack("=IHHII", 16 + len(cn_msg), 3, 0, 0, 0) + cn_msg)  # NLMSG_DONE

    def run(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return
            offset = 0
            while offset + 16 <= len(data):
                (length,) = struct.unpack_from("=I", data, offset)
                message = data[offset + 16:offset + length]
                # cn_msg (20 bytes), then proc_event: what, cpu, timestamp (16 bytes), then the event
                if len(message) >= 44 and struct.unpack_from("=I", message, 20)[0] == PROC_EVENT_EXEC:
                    _, tgid = struct.unpack_from("=II", message, 36)
                    self.seen[tgid].append((time.time(), cmdline(tgid).decode(errors="replace").strip()[:400]))
                if length == 0:
                    break
                offset += (length + 3) & ~3


def kind(command: str) -> str:
    """What a command line is, at the grain that shows where time goes."""
    words = command.split()
    if not words:
        return "?"
    program = os.path.basename(words[0])
    rest = words[1:]
    if program.startswith("python"):
        while rest and rest[0] in ("-u", "-I", "-B", "-S", "-P", "-E", "-s"):
            rest = rest[1:]
        if rest[:2] == ["-m", "relaunch.cli"]:
            return "relaunch " + (rest[2] if len(rest) > 2 else "")
        if rest[:1] == ["-m"] and len(rest) > 1:
            return "python -m " + rest[1]
        if rest[:1] == ["-c"]:
            if "import sys;exec(eval(sys.stdin.readline()))" in command:
                return "pytest-xdist worker"
            return "python -c " + " ".join(rest[1:4])[:40]
        script = next((w for w in rest if w.endswith(".py") or "/bin/" in w), "")
        if script:
            name, after = os.path.basename(script), rest[rest.index(script) + 1:]
            if name == "relaunch":          # the console script: python .../bin/relaunch COMMAND
                return "relaunch " + (after[0] if after else "")
            return "python " + name
        return "python " + " ".join(rest)[:40]
    if program == "relaunch":
        return "relaunch " + (rest[0] if rest else "")
    if program in ("bash", "sh") and rest:
        return f"{program} {os.path.basename(rest[0]) if not rest[0].startswith('-') else ' '.join(rest[:2])}"[:50]
    if program.startswith("sshd"):
        return "sshd"
    return program


def attribute(records: bytes, execs: dict[int, list[tuple[float, str]]]) -> dict[str, list[float]]:
    """kind -> [processes, CPU seconds] from the accounting file: each record is a process that
    ended; its kind is that of the last program it exec'd before it ended."""
    table: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for offset in range(0, len(records) - ACCT_V3.size + 1, ACCT_V3.size):
        fields = ACCT_V3.unpack_from(records, offset)
        pid, btime, etime, utime, stime, comm = fields[6], fields[8], fields[9], fields[10], fields[11], fields[18]
        ended = btime + etime / AHZ
        ran = [cmd for when, cmd in execs.get(pid, ()) if btime - 1 <= when <= ended + 1]
        name = kind(ran[-1]) if ran else "[" + comm.split(b"\0")[0].decode(errors="replace") + "]"
        row = table[name]
        row[0] += 1
        row[1] += (comp_t(utime) + comp_t(stime)) / AHZ
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=40, help="rows to print (default 40)")
    parser.add_argument("command", nargs="*", help="the command to run (default: python -m pytest)")
    args = parser.parse_args()
    command = args.command or [sys.executable, "-m", "pytest"]
    if os.geteuid() != 0:
        sys.exit("suite_cpu: needs root (acct(2), the proc connector)")
    libc = ctypes.CDLL(None, use_errno=True)
    execs = Execs()
    execs.start()
    with tempfile.TemporaryDirectory(prefix="suite-cpu-") as folder:
        log = Path(folder) / "acct"
        log.touch(mode=0o600)
        if libc.acct(str(log).encode()) != 0:
            sys.exit(f"suite_cpu: acct: {os.strerror(ctypes.get_errno())}")
        start = time.monotonic()
        try:
            status = subprocess.call(command)
        except KeyboardInterrupt:
            status = 130
        finally:
            libc.acct(None)     # accounting is the machine's: never left on
        wall = time.monotonic() - start
        table = attribute(log.read_bytes(), execs.seen)
    total = sum(cpu for _, cpu in table.values())
    cores = os.cpu_count() or 1
    print(f"\n{' '.join(command)}: exit {status}, {wall:.0f} s on {cores} cores; "
          f"{total:.0f} CPU s in {sum(int(n) for n, _ in table.values())} processes "
          f"({total / (wall * cores):.0%} of the cores)")
    print(f"{'CPU s':>8} {'share':>6} {'procs':>7}  kind")
    for name, (count, cpu) in sorted(table.items(), key=lambda item: -item[1][1])[:args.top]:
        print(f"{cpu:8.1f} {cpu / total:6.1%} {int(count):7d}  {name}")
    return status


if __name__ == "__main__":
    sys.exit(main())
