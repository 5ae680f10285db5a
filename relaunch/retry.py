"""The one retry policy: what may be retried is retried here, with tenacity, never in a loop of
its own. Waits grow by 1.6x each time, end at a deadline or after a number of attempts, and end at
once when relaunch is interrupted (the sleeps are `processes.sleep`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from . import processes

# seconds one reconnection may take once a loop (sync, watch) runs: an outage is not a boot
RECONNECT_WAIT = 20.0
T = TypeVar("T")


class Transient(Exception):
    """A failure worth another try (a stream error, a dropped connection)."""


def retrying(func: Callable[[], T], *, transient: Callable[[BaseException], bool],
             attempts: int | None = None, within: float | None = None, first: float = 1.0, most: float = 10.0,
             stop_early: Callable[[BaseException], float | None] | None = None,
             on_retry: Callable[[BaseException, float], None] | None = None,
             cancel: threading.Event | None = None) -> T:
    """Call func until it succeeds, raises something not transient, or the policy gives up
    (then the last error is raised as it was).

    attempts / within: at most that many calls / keep trying for that many seconds.
    stop_early(exc) may return a shorter number of seconds left for this kind of failure.
    on_retry(exc, seconds) is told before each wait.
    cancel: an event that also ends a wait (Interrupted), beside relaunch's own interruption.
    """
    start = time.monotonic()

    def stop(state: RetryCallState) -> bool:
        limits = []
        if attempts is not None:
            limits.append(stop_after_attempt(attempts)(state))
        if within is not None:
            limits.append(stop_after_delay(within)(state))
        exc = state.outcome.exception() if state.outcome else None
        if exc is not None and stop_early is not None:
            left = stop_early(exc)
            if left is not None and left <= 0:
                return True
        return any(limits)

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        seconds = state.next_action.sleep if state.next_action else 0.0
        if within is not None:
            seconds = min(seconds, max(within - (time.monotonic() - start), 0.1))
        if on_retry and exc is not None:
            on_retry(exc, seconds)

    policy = Retrying(stop=stop, wait=wait_exponential(multiplier=first, min=first, max=most, exp_base=1.6),
                      retry=retry_if_exception(transient), sleep=lambda s: processes.sleep(s, also=cancel),
                      before_sleep=before_sleep,
                      reraise=True)
    return policy(func)
