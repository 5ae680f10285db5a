"""`relaunch run`'s pure parts: where a node stands, read from each engine's variables (Slurm's
completed by scontrol, given here as its output), the hashes a node hands node 0, and the signals
relaunch's own commands outlive while training runs."""

from __future__ import annotations

import pytest

from relaunch import processes
from relaunch.errors import UsageError
from relaunch.host.hashing import FileHash, parse_hashes
from relaunch.injob.engine import Placement, kill_wait, node_address, placement
from relaunch.injob.group import hash_lines

CONFIG = "Configuration data as of 2026-12-06T22:00:00\nKillWait                = 45 sec\nKillOnBadExit = 0\n"


def scontrol(answers: dict[str, str]):  # type: ignore[no-untyped-def]
    asked: list[list[str]] = []

    def run(args: list[str]) -> str:
        asked.append(args)
        return answers.get(" ".join(args[:2]), "")
    run.asked = asked  # type: ignore[attr-defined]
    return run


def test_slurm_gives_rank_nodes_node_0s_address_the_run_and_killwait() -> None:
    env = {"SLURM_JOB_ID": "12", "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]",
           "SLURM_RESTART_COUNT": "3", "SLURMD_NODENAME": "gpu08"}
    answers = {"show hostnames": "gpu07\ngpu08\n", "show node": "NodeName=gpu07 Arch=x86_64 NodeAddr=10.1.0.7 "
               "NodeHostName=gpu07", "show config": CONFIG}
    found = placement(env, scontrol(answers))
    assert found == Placement("slurm", "gpu08", 1, 2, "10.1.0.7", "slurm-12-3", 3, 45.0, "Slurm job 12 (restart 3)")
    assert found.label == "gpu08 (node 1 of 2)"


def test_slurm_on_one_node_asks_no_hostnames_and_a_silent_scontrol_means_killwait_30() -> None:
    ask = scontrol({})
    found = placement({"SLURM_JOB_ID": "5", "SLURMD_NODENAME": "n0"}, ask)
    assert (found.nnodes, found.master, found.grace, found.job) == (1, "", 30.0, "Slurm job 5")
    assert ask.asked == [["show", "config"]]         # type: ignore[attr-defined]


def test_skypilot_dstack_kubernetes_and_none() -> None:
    sky = placement({"SKYPILOT_TASK_ID": "sky-1", "SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_NODES": "2",
                     "SKYPILOT_NODE_IPS": "10.0.0.4\n10.0.0.5\n", "HOSTNAME": "w1"}, scontrol({}))
    assert (sky.engine, sky.rank, sky.nnodes, sky.master, sky.run_key, sky.grace) == \
        ("skypilot", 1, 2, "10.0.0.4", "sky-1", None)
    dstack = placement({"DSTACK_RUN_NAME": "ft", "DSTACK_NODE_RANK": "0", "DSTACK_NODES_NUM": "2",
                        "DSTACK_MASTER_NODE_IP": "10.2.0.1", "HOSTNAME": "d0"}, scontrol({}))
    assert (dstack.engine, dstack.master, dstack.run_key, dstack.grace) == ("dstack", "10.2.0.1", "ft", 10.0)
    pod = placement({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "HOSTNAME": "ft-0-abcde"}, scontrol({}))
    assert (pod.engine, pod.node, pod.nnodes, pod.grace) == ("kubernetes", "ft-0-abcde", 1, 30.0)
    alone = placement({"HOSTNAME": "box"}, scontrol({}))
    assert (alone.engine, alone.nnodes, alone.grace) == ("", 1, None)


def test_relaunch_variables_win_and_a_group_needs_an_address_and_a_run() -> None:
    pod = placement({"KUBERNETES_SERVICE_HOST": "x", "HOSTNAME": "p", "RELAUNCH_NODE_RANK": "2", "RELAUNCH_NNODES": "4",
                     "RELAUNCH_MASTER_ADDR": "ft-0.ft", "RELAUNCH_RUN_KEY": "ft-7"}, scontrol({}))
    assert (pod.rank, pod.nnodes, pod.master, pod.run_key) == (2, 4, "ft-0.ft", "ft-7")
    with pytest.raises(UsageError, match="no address for node 0"):
        placement({"RELAUNCH_NNODES": "2", "RELAUNCH_RUN_KEY": "k"}, scontrol({}))
    with pytest.raises(UsageError, match="nothing names this run on every node"):
        placement({"RELAUNCH_NNODES": "2", "RELAUNCH_MASTER_ADDR": "a"}, scontrol({}))
    with pytest.raises(UsageError, match="node rank 3 of 2"):
        placement({"RELAUNCH_NODE_RANK": "3", "RELAUNCH_NNODES": "2"}, scontrol({}))
    with pytest.raises(UsageError, match="SLURM_NNODES='two'"):
        placement({"SLURM_JOB_ID": "1", "SLURM_NNODES": "two"}, scontrol({}))


def test_scontrol_outputs() -> None:
    assert node_address("NodeName=n0 NodeAddr=10.213.4.2 NodeHostName=n0 Version=22.05.8") == "10.213.4.2"
    assert node_address("") == ""
    assert kill_wait(CONFIG) == 45.0 and kill_wait("") is None


def test_a_nodes_hashes_reach_node_0_as_the_hasher_wrote_them() -> None:
    hashes = {"step-5/__1_0.distcp": FileHash("step-5/__1_0.distcp", 4096, {"sha256": "ab" * 32, "md5": "cd" * 16}),
              "step-5/gone": FileHash("step-5/gone", missing=True),
              "step-5/half.pt": FileHash("step-5/half.pt", 10, {"sha256": "ef" * 32}, "truncated zip")}
    assert parse_hashes(hash_lines(hashes).encode()) == hashes


def test_relaunch_s_own_commands_outlive_the_engine_s_signals_while_shielded() -> None:
    """Slurm signals every process of the job; a copy relaunch run runs for the stop's save must
    not die of the signal that asked for the save."""
    argv = ["bash", "-c", "kill -USR1 $$; kill -TERM $$; echo alive"]
    assert processes.run(argv, deadline=30).status == -10          # as any process of the job would
    try:
        processes.SHIELDED[:] = ["TERM", "USR1"]
        done = processes.run(argv, deadline=30)
    finally:
        processes.SHIELDED.clear()
    assert (done.status, done.text) == (0, "alive\n")
