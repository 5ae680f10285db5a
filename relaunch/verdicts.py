"""Every promise relaunch makes, in one place: each verdict is a pure function of what was
observed at the moment it is given (the bytes in the store, the instance's listing and log, what
the executor's actions returned), never of relaunch's own bookkeeping.

The manifest chooses what to copy and what to restore; it is never the evidence. A record says
what the store should hold; `store_holds` compares it with what the store holds *now* (a local
store: the size and sha256 of its bytes; an rclone remote: the listing's size and the remote's own
hash; a Hub repo: the head's file list with its LFS sha256 or git blob id).
"""

from __future__ import annotations

from dataclasses import dataclass

from .manifest import CheckpointRecord, FileRecord, Seen


@dataclass(frozen=True)
class Verdict:
    ok: bool
    why: str                         # in words, for the user: what was seen that decided it

    def __bool__(self) -> bool:
        return self.ok


def expected_hashes(want: FileRecord) -> dict[str, str]:
    """Every hash the record knows for a file: its sha256, and the store's own (md5, git blob id)."""
    return {"sha256": want.sha256, **want.extra}


def file_problem(path: str, want: FileRecord, seen: Seen | None, size_only: bool = False) -> str | None:
    """What is wrong with one file of a record as the store holds it now; None when it holds it."""
    if seen is None:
        return f"{path}: missing from the store"
    if seen.size != want.size:
        return f"{path}: size {seen.size} in the store, recorded {want.size}"
    if size_only:
        return None
    expected = expected_hashes(want)
    common = [kind for kind in seen.hashes if kind in expected]
    if not common:
        return (f"{path}: the store gives no hash the record knows (it gives "
                f"{', '.join(sorted(seen.hashes)) or 'none'}); not proven")
    for kind in common:
        if seen.hashes[kind] != expected[kind]:
            return f"{path}: {kind} {seen.hashes[kind]} in the store, recorded {expected[kind]}"
    return None


def store_holds(record: CheckpointRecord, seen: dict[str, Seen], size_only: bool = False) -> list[str]:
    """What keeps the store from holding `record` now (missing, different size or hash); [] = it does.

    `size_only`: presence and size (for choosing a checkpoint to restore, whose bytes are
    verified again where they land)."""
    return [problem for path, want in sorted(record.files.items())
            if (problem := file_problem(path, want, seen.get(path), size_only)) is not None]


def differing(record: CheckpointRecord, seen: dict[str, Seen]) -> list[str]:
    """The record's files the store holds with other bytes than recorded (not merely missing, nor
    unproven for want of a common hash): what a new copy must not overwrite."""
    out = []
    for path, want in sorted(record.files.items()):
        got = seen.get(path)
        if got is None:
            continue
        expected = expected_hashes(want)
        if got.size != want.size or any(got.hashes[k] != expected[k] for k in got.hashes if k in expected):
            out.append(path)
    return out


@dataclass(frozen=True)
class Progress:
    """What the training on an instance has done, as seen there (for an instance with nothing to copy)."""

    ckpt_dir: str
    dir_exists: bool
    log_step: int | None             # the newest step its log shows (run.metrics.step), None if none
    session_alive: bool
    session_age: float | None        # seconds the tmux session has been alive
    grace: float                     # run.grace
    unseen: str = ""                 # a run of this recipe this login cannot see (host.facts.unseen_run)


def nothing_to_copy(progress: Progress, stored_step: int | None, allow_empty: bool) -> Verdict:
    """An instance with no complete checkpoint: safe only when destroying it loses no training.

    Training made progress when its log shows a step beyond the store's newest, or (no step in
    its log) its session has been alive for longer than run.grace."""
    where = (f"{progress.ckpt_dir} does not exist" if not progress.dir_exists
             else f"{progress.ckpt_dir} holds no complete checkpoint")
    if progress.unseen:
        # nothing here to copy says nothing of a run that is not here for this login: never "safe"
        return Verdict(False, f"{where}, and {progress.unseen}")
    lost: str | None = None
    if progress.log_step is not None and progress.log_step > (stored_step or 0):
        steps = progress.log_step - (stored_step or 0)
        lost = f"the log says step {progress.log_step}; {where}: destroying loses {steps} steps"
    elif progress.log_step is None and progress.session_alive and progress.session_age is None:
        # unknown is never "no progress"
        lost = (f"no step in the log, and how long training has run could not be read (the tmux session's "
                f"start or the instance's clock); {where}: destroying may lose all of it")
    elif progress.log_step is None and progress.session_alive and progress.session_age is not None \
            and progress.session_age > progress.grace:
        lost = (f"training has run for {progress.session_age:.0f}s (longer than run.grace, "
                f"{progress.grace:g}s); {where}: destroying loses all of it")
    if lost is None:
        return Verdict(True, f"{where}, and training has made no progress beyond the store's newest checkpoint")
    if allow_empty:
        return Verdict(True, f"{lost} (accepted with --allow-empty)")
    return Verdict(False, lost)


def evacuation(newest: str | None, verified_now: list[str], empty: Verdict | None) -> Verdict:
    """`safe to destroy`: the instance's newest complete checkpoint is in the store now (its bytes
    checked after the copy, `verified_now`), or it has none and destroying loses nothing (`empty`)."""
    if newest is None:
        return empty if empty is not None else Verdict(True, "no checkpoint on the instance")
    if newest in verified_now:
        return Verdict(True, f"{newest} is in the store, checked after the copy")
    return Verdict(False, f"the newest checkpoint on the instance, {newest}, is not verified in the store")


def sync_round(at_start: str | None, verified_now: list[str], newest: str | None,
               began: str | None = None) -> Verdict:
    """A copy-off round while training runs (`sync --once`, a watch's round): verified when the store
    holds now (checked after the copy) the instance's newest complete checkpoint of the moment the
    round began (`at_start`; `began`, when the trainer deleted that one meanwhile and at_start is the
    newest it holds now). Training may save newer ones while the round copies: those are the next
    round's, and only `evacuate` (training stopped, or asked to) insists on the very newest."""
    if at_start is None:
        return Verdict(True, "no checkpoint on the instance when the round began" if began is None else
                             f"{began}, the newest when the round began, is gone from the instance, and it holds "
                             "no other")
    if at_start not in verified_now:
        when = "when the round began" if began in (None, at_start) else f"now ({began} is gone from it)"
        return Verdict(False, f"{at_start}, the newest checkpoint on the instance {when}, is not verified in the "
                              "store")
    later = f"; training wrote {newest} meanwhile: the next round copies it" if newest and newest != at_start else ""
    return Verdict(True, f"{at_start} is in the store, checked after the copy{later}")


@dataclass(frozen=True)
class NoticeCopy:
    """What was seen of the save a reclaim notice asked for and of its copy."""

    save_state: str | None           # the guard's word: saved (exit 0 after the stop, a file written after the
                                     # notice), no save (exit 0, none), exited, not running, still running...
    noticed_at: float                # when the guard saw the notice (the instance's clock)
    deadline: float                  # the notice's deadline (the instance's clock)
    finished: float                  # when the copy's verdict was given (this machine's clock)
    clock_offset: float = 0.0        # the instance's clock minus this machine's, measured at the looks
    newest: str | None = None        # the newest complete checkpoint on the instance after the stop
    newest_step: int | None = None
    newest_mtime: float | None = None    # when its last file was written (the instance's clock)
    verified_now: tuple[str, ...] = ()   # checkpoints checked in the store after the copy (by their bytes)
    seen_step: int | None = None     # the newest step training showed (its log, its checkpoints)


def notice_saved(seen: NoticeCopy) -> Verdict:
    """The notice's save made the deadline: the newest complete checkpoint training left holds every
    step it showed (nothing trained after it), it is that save (written after the notice; or training
    was not running when the notice came), it is verified in the store by its bytes, and all of that
    before the deadline, on the instance's clock (`finished` moved there by the measured offset). A
    copy of an older checkpoint, however fast, is not that save; nor is a periodic save of a training
    that went on; nor is an exit status: a training that exits 0 without saving (a save its deadline
    had no room for) leaves an older checkpoint behind."""
    state = seen.save_state
    unsaved = None if state in ("saved", "not running") else {
        "still running": "training had not finished saving when the copy began (run.stop.timeout)",
        "exited": "training exited with a failure status after the notice",
        "no save": "training exited 0 after the stop without writing a checkpoint",
        "not asked": "training could not be asked to save"}.get(state or "", "the guard never said that training "
                                                                            "saved")
    if seen.newest is None:
        return Verdict(False, "there is no complete checkpoint on the instance" + (f"; {unsaved}" if unsaved else ""))
    named = f"{seen.newest} (step {seen.newest_step})" if seen.newest_step is not None else seen.newest
    if seen.newest not in seen.verified_now:
        return Verdict(False, f"{named} is not verified in the store")
    if seen.newest_step is not None and seen.seen_step is not None and seen.newest_step < seen.seen_step:
        return Verdict(False, f"{named} is older than step {seen.seen_step}, which training had reached: the save "
                              "after the notice is not in the store" + (f" ({unsaved})" if unsaved else ""))
    after = seen.newest_mtime is not None and seen.newest_mtime >= seen.noticed_at
    if state == "saved" and not after:
        return Verdict(False, f"{named} was written before the notice: training exited 0 after the stop without "
                              "saving a newer checkpoint")
    if unsaved and not after:
        return Verdict(False, f"{named} was written before the notice, and {unsaved}")
    finished = seen.finished + seen.clock_offset
    skew = offset_words(seen.clock_offset)
    skew = f" ({skew})" if skew else ""
    if finished > seen.deadline:
        return Verdict(False, f"{named} was verified {finished - seen.deadline:.0f}s after the deadline{skew}")
    return Verdict(True, f"{named} verified in the store {seen.deadline - finished:.0f}s before the deadline{skew}")


SKEW_SHOWN = 2.0            # seconds of clock offset worth saying


def offset_words(offset: float | None) -> str:
    """The instance's clock against this machine's, in words, when it is off by more than SKEW_SHOWN."""
    if offset is None or abs(offset) <= SKEW_SHOWN:
        return ""
    return (f"the instance's clock is {abs(offset):.0f}s {'ahead of' if offset > 0 else 'behind'} this machine's; "
            "deadlines are read on the instance's")


def end_replaced(listed: bool, newest: str | None, newest_step: int | None, held: str | None,
                 held_step: int | None) -> Verdict:
    """A replaced instance that answers again still training: its training may be ended (two
    trainings would write one store) only when that loses no checkpoint: its newest complete one is
    known (`listed`: its checkpoint.dir read at this look; `newest`) and the store holds one at least
    as new by its bytes, checked now (`held`: the newest record verdicts.store_holds passed), not on
    the manifest's word. Unknown never ends it."""
    if not listed:
        return Verdict(False, "its checkpoint.dir could not be read: what it holds is unknown")
    if newest is None or newest_step is None:
        return Verdict(False, "it holds no complete checkpoint: how far it trained is unknown")
    named = f"{newest} (step {newest_step})"
    if held is None or held_step is None:
        return Verdict(False, f"it holds {named}, and the store holds no checkpoint by its bytes now")
    if held_step < newest_step:
        return Verdict(False, f"it holds {named}, newer than the newest checkpoint the store holds by its bytes now, "
                              f"{held} (step {held_step})")
    return Verdict(True, f"it holds nothing newer than the store: its newest is {named}, and the store holds {held} "
                         f"(step {held_step}), its bytes checked now")


def launched(state: str | None) -> Verdict:
    """`up` exit 0: the command is running (its ready line seen; without one, the step in its log gone
    up; or alive after run.grace) or finished."""
    if state == "ready":
        return Verdict(True, "its log printed the ready line")
    if state == "progressing":
        return Verdict(True, "the step its log shows went up: a training step ran")
    if state == "alive":
        return Verdict(True, "alive after run.grace")
    if state == "finished":
        return Verdict(True, "the command already finished (exit 0)")
    return Verdict(False, "the command died at start")
