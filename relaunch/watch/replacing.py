"""The watch's recovery: recover.command rents replacements (recover.py reads its answer), `up`
brings training back there; in a node group with recover.shrink the nodes left resume at once and
the group grows back when the replacements are ready; replaced instances that answer again are
looked at, their training ended only when the store holds, by its bytes checked then, a checkpoint
as new as their newest (verdicts.end_replaced; unknown never ends it).
"""

from __future__ import annotations

import queue
import time

from .. import cycle, history, verdicts
from ..errors import ConnectError, Interrupted, RelaunchError, UsageError
from ..host.connection import connect
from ..host.spec import HostSpec
from ..layouts import complete_checkpoints
from ..manifest import CheckpointRecord
from ..retry import retrying
from ..transports import open_store
from . import recover as rent
from .failures import first_line, recoverable
from .looks import Looker, View
from .state import WatchBase

REPLACED_LOOKS = 5            # a replaced instance is looked at every REPLACED_LOOKS x guard.every seconds


class Replacing(WatchBase):
    """Watch's methods for renting and bringing up replacements (a mixin: its state lives in Watch)."""

    # -- recovery ------------------------------------------------------------------------------
    def recover(self, entry: history.Interruption, gone: list[HostSpec]) -> None:
        """Replace what is gone, or (a group with recover.shrink) go on with the nodes left."""
        self.rounds.abort()
        self.still_holding()
        left = [s for s in self.specs if s not in gone]
        old = self.host if not self.group else f"the group ({len(self.specs)} nodes)"
        if self.group and self.recipe.recover.shrink and left:
            self.say(f"recover.shrink: training goes on on the {len(left)} node(s) left now"
                     + (f"; replacements for {len(gone)} are rented meanwhile" if self.recipe.recover.command else ""))
            cycle.stop_training(self.current(), left, self.inner)
            results = self.bring_up(left)
            self.grow_after = results[0].step
            if self.recipe.recover.command:
                # another loss while earlier replacements are still being rented adds to them: every
                # one rented is used when the group grows back (or named when the watch ends)
                with self.spare_lock:
                    group = [*self.specs, *(r.spec for r in self.spares)]
                self.renting.append(self.background.submit(self.rent_and_prepare, entry, len(gone), group))
        else:
            # what earlier shrinks rented counts towards the replacements (the last nodes of a shrunk
            # group lost too): rented once, never forgotten
            spares = self.take_spares()
            need = max(self.size - len(left) - len(spares), 0) if self.group else len(gone)
            rented = [*spares, *self.rent_many(entry, need, already=spares)]
            if left:
                cycle.stop_training(self.current(), left, self.inner)
            results = self.bring_up(left + [r.spec for r in rented], new=rented)
        self.retire([s for s in gone])
        entry.resumed(self.host, time.time())
        entry.nodes_after = len(self.specs)
        self.write_down(entry)
        first = results[0]
        resumed = f"resumed from {first.checkpoint} (step {first.step})" if first.checkpoint else "fresh start"
        self.ok(f"recovered: training {first.status} on {self.host} ({resumed}), "
                f"{entry.time_to_resume:g}s after {old} stopped; watching {self.host} now")
        self.emit("up", **first.as_dict(), nodes=[str(s) for s in self.specs])
        self.tell(entry)

    def rent_many(self, entry: history.Interruption, count: int,
                  already: list[rent.Rented] | None = None) -> list[rent.Rented]:
        """`count` replacements; a failure names every one rented before it (they bill)."""
        rented: list[rent.Rented] = []
        for n in range(count):
            try:
                rented.append(self.rent_one(entry, n))
            except RelaunchError as exc:
                billing = [*(already or []), *rented]
                if billing:
                    hosts = " ".join(str(r.spec) for r in billing)
                    exc.message += (f"\nrented for this recovery and billing: {hosts}: run `relaunch up RECIPE "
                                    "HOST...` there, or destroy them")
                raise
        return rented

    def rent_and_prepare(self, entry: history.Interruption, count: int, group: list[HostSpec]) -> None:
        """recover.shrink, in a background thread: the replacements are rented while the shrunk group
        trains, each added to `spares` as soon as recover.command gave it, and their env is made then
        too, so that growing back installs nothing while training is stopped. `group`: the nodes as
        they were when this renting began (the loop's specs may change meanwhile); the env is made
        as the node it will likely be, and `up` makes it again where that rendered differently."""
        spares: list[rent.Rented] = []
        for n in range(count):
            found = self.rent_one(entry, n)
            with self.spare_lock:
                self.spares.append(found)
            spares.append(found)
        group = [*group, *(r.spec for r in spares)]           # as growing back will make it
        for rank, found in enumerate(spares, start=len(group) - len(spares)):
            self._post("say", f"recover: making the env on {found.spec} while the group trains (preflight, venv, "
                              "lock, env.files, env.setup)")
            try:
                cycle.prepare(self.current(self.recipe.ssh.wait), group, rank, self.inner)
            except (Interrupted, UsageError):
                raise
            except RelaunchError as exc:
                self._post("warn", f"recover: the env on {found.spec} could not be made ahead "
                                   f"({first_line(exc)}); the `up` that grows the group back makes it")

    def take_spares(self) -> list[rent.Rented]:
        """Every replacement rented by earlier shrinks, once their renting is over (each bounded by
        recover.attempts and recover.timeout); they leave `spares`."""
        for renting in self.renting:
            try:
                renting.result()
            except (Interrupted, UsageError):
                raise
            except RelaunchError as exc:
                self.warn(f"recover: renting a replacement failed: {first_line(exc)}")
        self.renting = []
        with self.spare_lock:
            spares, self.spares = self.spares, []
        return spares

    def say_unused(self) -> None:
        """The watch ends: replacements rented and not (yet) in the group bill; they are named."""
        with self.spare_lock:
            unused = list(self.spares)
        if unused:
            hosts = " ".join(str(r.spec) for r in unused)
            self.warn(f"the replacement{'s' if len(unused) > 1 else ''} {hosts} rented by recover.command "
                      f"{'are' if len(unused) > 1 else 'is'} not in the group and billing: `relaunch up RECIPE "
                      "HOST...` with them, or destroy them")
            self.emit("unused", nodes=[str(r.spec) for r in unused])
        if any(not f.done() for f in self.renting):
            self.warn("a replacement was being rented when the watch stopped: recover.command may have rented an "
                      "instance; look at your provider's console")

    def rent_one(self, entry: history.Interruption, n: int) -> rent.Rented:
        """recover.command until it names a HOST that answers with an accepted key. Once it has
        named one, a later attempt connects to that one again: nothing more is rented for it (only
        a command that failed, exit non-zero before its timeout, rented nothing and may be run again)."""
        recover = self.recipe.recover
        attempt = [0]
        rented: list[rent.Rented] = []
        for_whom = f" ({n + 1} of the lost nodes)" if self.group else ""

        def once() -> rent.Rented:
            attempt[0] += 1
            if rented:
                found = rented[0]
                self._post("say", f"recover attempt {attempt[0]} of {recover.attempts}{for_whom}: connecting to "
                                  f"{found.spec} again (rented already: nothing more is rented)")
            else:
                why = self.holder.why_not_mine()
                if why is not None:
                    raise rent.RecoverStopped(f"{why}: renting nothing", refused=True)
                self._post("say", f"recover attempt {attempt[0]} of {recover.attempts}{for_whom}: running "
                                  f"recover.command `{recover.command}` (up to {recover.timeout:g}s)")
                found = rent.rent(self.recipe, self.inner, attempt[0], entry.host, entry.cause)
                rented.append(found)
                if found.note:
                    self._post("warn", f"recover: {found.note}")
                self._post("say", f"recover.command gave {found.spec}" + (f" {found.pin}" if found.pin else ""))
                self.emit("recover", new_host=str(found.spec), host_key=found.pin, attempt=attempt[0])
            self.admit(found)
            return found

        def again(exc: BaseException, seconds: float) -> None:
            self._post("warn", f"recover attempt {attempt[0]} of {recover.attempts} failed: {first_line(exc)}; "
                               f"next in {seconds:.0f}s")

        try:
            return retrying(once, transient=recoverable, attempts=recover.attempts, first=5.0, most=120.0,
                            on_retry=again)
        except RelaunchError as exc:
            if rented:
                exc.message += (f"\n{rented[0].spec} was rented by recover.command and is billing: reach it (its key, "
                                "its user) and run `relaunch up RECIPE HOST` there, or destroy it")
            raise

    def drain_messages(self) -> None:
        while True:
            try:
                kind, text = self.messages.get_nowait()
            except queue.Empty:
                return
            self._show(kind, text)

    def admit(self, found: rent.Rented) -> None:
        """A new instance from recover.command: wait for it to boot, and accept its key for that
        address (or check the pin): what an earlier instance left there in known_hosts is gone."""
        recipe = self.recipe.model_copy(update={"ssh": self.recipe.ssh.model_copy(update={"host_key": found.pin})})
        target = cycle.make_target(recipe, found.spec)
        remote = connect(target, booting=True, accept_new_host_key=found.pin is None, say=self.inner.say)
        remote.close()
        self.unpinned = True
        self._post("say", f"recover: {found.spec} answers" + (f" with the pinned host key {found.pin}" if found.pin
                                                              else "; its host key is accepted for that address "
                                                                   "(a new instance from recover.command)"))

    def bring_up(self, specs: list[HostSpec], new: list[rent.Rented] | None = None) -> list[cycle.UpResult]:
        self.say(f"recover: `up` on {' '.join(map(str, specs))}")

        def again(exc: BaseException, seconds: float) -> None:
            self.warn(f"recover: up failed: {first_line(exc)}; again in {seconds:.0f}s")

        def up() -> list[cycle.UpResult]:
            self.still_holding()
            return cycle.up(self.current(self.recipe.ssh.wait), specs, self.inner)

        try:
            results = retrying(up,
                               transient=lambda e: recoverable(e) and isinstance(e, ConnectError),
                               attempts=self.recipe.recover.attempts, first=5.0, most=60.0, on_retry=again)
        except RelaunchError as exc:
            if new:
                exc.message += (f"\nthe replacement{'s' if len(new) > 1 else ''} "
                                f"{' '.join(str(r.spec) for r in new)} {'are' if len(new) > 1 else 'is'} rented and "
                                "billing: fix the cause and run `relaunch up RECIPE HOST...` there, or destroy it")
            raise
        self.look_at(specs)
        self.next_round = time.monotonic() + self.recipe.checkpoint.every
        return results

    def grow_back(self) -> None:
        """recover.shrink: once every replacement being rented is there and the shrunk group's next
        checkpoint is verified in the store, the group saves (run.stop), is evacuated and comes back
        at full size, with every replacement rented (also those of a second loss meanwhile)."""
        if not self.renting and not self.spares:
            return
        for renting in [f for f in self.renting if f.done()]:
            self.renting.remove(renting)
            exc = renting.exception()
            if isinstance(exc, RelaunchError):
                self.warn(f"recover: renting a replacement failed: {first_line(exc)}")
        if self.renting:
            return                       # one grow back, with every replacement
        with self.spare_lock:
            spares = list(self.spares)
        if not spares:
            self.warn(f"recover: no replacement to grow back with; training goes on on {len(self.specs)} node(s)")
            return
        if not self.said_ready:
            self.said_ready = True
            self.say(f"replacement{'s' if len(spares) > 1 else ''} ready: {' '.join(str(r.spec) for r in spares)}; "
                     f"growing back at the next checkpoint verified in the store (after step {self.grow_after})")
        if (self.last_stored or 0) <= self.grow_after:
            return
        self.still_holding()
        self.said_ready = False
        before, old = len(self.specs), self.host
        entry = history.Interruption.start(old, "grow", f"{before} -> {before + len(spares)} nodes: replacements "
                                           f"{' '.join(str(r.spec) for r in spares)} are there", time.time(),
                                           self.newest_seen(), None)
        self.say(f"growing back to {before + len(spares)} nodes: asking training to save (run.stop), evacuating, "
                 "then `up` on the whole group")
        self.rounds.abort()
        try:
            # reverify: as after a notice, the newest is hashed on the instance again, never taken on its record
            report = cycle.evacuate(self.current(), self.specs, self.inner, stop=True, newest_only=True)
            entry.newest_verified_step = report.stored_step
            seen = max([s for s in (entry.newest_seen_step, report.newest_step) if s is not None], default=None)
        except (Interrupted, UsageError):
            raise
        except RelaunchError as exc:
            # stopped, but its save not verified: the grown group resumes from the store's newest
            self.warn(f"growing back: the save was NOT verified ({first_line(exc)}); the group comes back from the "
                      "newest checkpoint the store holds")
            entry.newest_verified_step = self.store_newest()
            seen = entry.newest_seen_step
        entry.newest_seen_step = seen
        entry.steps_lost = None if seen is None else max(seen - (entry.newest_verified_step or 0), 0)
        entry.nodes_before = before
        with self.spare_lock:            # from here on the group's (or named by bring_up's error)
            self.spares = [r for r in self.spares if r not in spares]
        results = self.bring_up(self.specs + [r.spec for r in spares], new=spares)
        entry.resumed(self.host, time.time())
        entry.nodes_after = len(self.specs)
        self.write_down(entry)
        first = results[0]
        self.ok(f"grown back: training {first.status} on {self.host} ({len(self.specs)} nodes, resumed from "
                f"{first.checkpoint or 'nothing'}), {entry.time_to_resume:g}s without training")
        self.emit("up", **first.as_dict(), nodes=[str(s) for s in self.specs])
        self.tell(entry)

    # -- replaced instances --------------------------------------------------------------------
    def retire(self, specs: list[HostSpec]) -> None:
        """A replaced instance may come back (a network outage, a paused instance): look at it now and
        then. Not one whose address a current node has now: the provider gave it away, and what
        answers there is the new instance."""
        self.alive_said.clear()
        for spec in specs:
            if self._taken(spec):
                continue
            looker = Looker(self.current(5), spec, max(REPLACED_LOOKS * self.every, 10.0), self.wake).start()
            self.replaced[str(spec)] = looker

    def _taken(self, spec: HostSpec) -> bool:
        mine = cycle.make_target(self.recipe, spec)
        return any((t.address, t.port) == (mine.address, mine.port)
                   for t in (cycle.make_target(self.recipe, s) for s in self.specs))

    def newest_held(self) -> CheckpointRecord | None:
        """The newest checkpoint the store holds now by its bytes (size and hash, read again), not by its
        record; None when it holds none, or cannot be read (which never ends a training)."""
        try:
            store = open_store(self.recipe)
            store.read()
            for record in reversed(store.manifest.ordered() if store.manifest else []):
                if not verdicts.store_holds(record, store.observe(record)):
                    return record
        except (Interrupted, UsageError):
            raise
        except RelaunchError as exc:
            self._post("warn", f"reading the store: {first_line(exc)}")
        return None

    def look_at_replaced(self) -> None:
        for name, looker in list(self.replaced.items()):
            view = looker.view()
            if view.fatal is not None or self._taken(view.spec):   # another machine there now: it is gone
                looker.stop()
                del self.replaced[name]
                continue
            if view.look is None or view.silent_since is not None or self.ending is not None:
                continue
            looker.stop()
            del self.replaced[name]
            if not view.look.training:
                self.warn(f"{name} (replaced) answers again; its training is not running. It is still billing "
                          "until you destroy it")
                continue
            # the store's bytes are hashed: in the background, never holding up the loop
            self.ending = self.background.submit(self.end_replaced, view)

    def end_replaced(self, view: View) -> None:
        """End a replaced instance's training when that loses no checkpoint (verdicts.end_replaced),
        else leave it running and say why; from a background thread."""
        assert view.look is not None
        name, listing, c = view.host, view.look.listing, self.recipe.checkpoint
        newest = complete_checkpoints(listing, c.layout, c.pattern) if listing is not None else []
        held = self.newest_held()
        verdict = verdicts.end_replaced(listing is not None, newest[-1].name if newest else None,
                                        newest[-1].step if newest else None, held.name if held else None,
                                        held.step if held else None)
        if not verdict:
            self._post("warn", f"{name} (replaced) answers again and is still training: left running, {verdict.why}. "
                               f"The replacement resumed from the store; keep one of them (`relaunch evacuate RECIPE "
                               f"{name} --stop` stops it) and destroy the other: both are billing")
            return
        self._post("warn", f"{name} (replaced) answers again and was still training; {verdict.why}: ending its "
                           "training now. It is still billing until you destroy it")
        self.emit("replaced-back", node=name)
        cycle.stop_training(self.current(10), [view.spec], self.inner)
