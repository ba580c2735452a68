"""The two drivers of a batcher's rounds (:class:`~snac_fast.batching.rounds.BatchRounds`): who runs
the engine calls, and when.

- :class:`ThreadDriver`: a thread of its own, woken only when it sleeps. Each round's calls are
  launched in order, each call's results handed out while the next runs on the GPU, the round's last
  call delivered once the next round's first is launched (or before the thread sleeps).
- :class:`LoopDriver`: an asyncio event loop's own thread, between its other callbacks: a call is
  launched when pushes are pending and fewer than two calls are in flight, and each call's copy to
  the host is polled (never waited for) until it lands. No second thread takes the interpreter
  between the engine's CUDA calls (on some hosts that hand-over stalls them: docs/batching.md).

Both keep their state (requests carried to the next round, calls formed and in flight) as their
own attributes, and both honour ``max_wait_ms`` (an unfilled round starts that long after the last,
at once for a stream's first audio: :mod:`snac_fast.batching.intake`) and ``idle_timeout_s`` (a
sweep every quarter of it).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from concurrent.futures import Future

from snac_fast.batching.rounds import BatchRounds

FULLNESS_POLL_S = 0.005  # a thread waiting for fuller calls (max_wait_ms) looks again this often


class ThreadDriver:
    """Runs ``rounds``' engine calls on a thread of its own (started now)."""

    def __init__(self, rounds: BatchRounds) -> None:
        self.rounds = rounds
        self.carried: list = []  # a stream's later requests wait for its earlier one
        self.in_flight: tuple | None = None  # the round before's last call, launched but not delivered
        self._wake = threading.Event()
        self._sleeping = False
        self._waiting_for_more = False  # max_wait_ms: only a first audio's push wakes it
        self._thread = threading.Thread(target=self._serve, name="snac-fast-batcher", daemon=True)
        self._thread.start()

    def notify(self) -> None:
        if self._sleeping or (self._waiting_for_more and self.rounds.intake.urgent_since != math.inf):
            self._wake.set()

    def stop(self) -> None:
        self._wake.set()
        self._thread.join()

    def _serve(self) -> None:
        rounds, intake = self.rounds, self.rounds.intake
        rounds.bind_thread()  # the engine's device_scope is then a no-op per call
        idle = rounds.idle_timeout
        next_sweep = time.monotonic() + (idle or 0) / 4
        while True:
            taken: list = []
            try:
                if self.in_flight is not None and not intake.pending and not self.carried:
                    self._land()  # nothing to launch meanwhile: deliver it now
                while not intake.pending and not self.carried and not intake.stopping:
                    self._sleep(idle / 4 if idle else None)
                    if idle and time.monotonic() >= next_sweep:
                        break
                if intake.wants_more(self.carried):
                    if self.in_flight is not None:
                        self._land()
                    while intake.wants_more(self.carried):
                        left = intake.deadline() - time.monotonic()  # a first audio's push: at once
                        if left <= 0:
                            break
                        self._wait_for_more(left)
                taken = intake.take()
                if intake.stopping and not taken and not self.carried:
                    if self.in_flight is not None:
                        self._land()
                    return
                if idle and time.monotonic() >= next_sweep:
                    rounds.release_idle()
                    next_sweep = time.monotonic() + idle / 4
                now, self.carried = rounds.split_round(self.carried + taken if self.carried else taken)
                if now:
                    self.in_flight = rounds.timed(self._run, now, self.in_flight)
                elif self.in_flight is not None:
                    self._land()
            except Exception as error:  # noqa: BLE001 - a bug of ours: fail what waits rather than hang every stream
                # the call in flight: its round's requests (which hold its own), else its chunk's
                flight = self.in_flight
                lost = self.carried + taken + ([] if flight is None else list(flight[0] or flight[1]))
                self.carried, self.in_flight = [], None
                rounds.fail(lost, error)

    def _land(self) -> None:
        flight, self.in_flight = self.in_flight, None
        self.rounds.timed(self.rounds.land, flight)

    def _run(self, requests: list, in_flight: tuple | None) -> tuple | None:
        """One round: its engine calls launched in order, each call's results handed out while the
        next runs on the GPU (its copy precedes that call in the stream), the round's last call left
        in flight. ``in_flight``: the round before's. Returns this round's."""
        rounds = self.rounds
        previous, launched = in_flight, None
        for chunk, call in rounds.calls(requests):
            launched = (None, *rounds.launch(chunk, call))
            if previous is not None:
                rounds.land(previous)
            previous = launched
        if launched is None:  # no engine call (releases, dropped pushes): done now
            rounds.mark_done(requests, time.monotonic())
            return previous
        return (requests, *launched[1:])

    def _wait_for_more(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for fuller calls: woken by a push a first audio waits on;
        looks at how full the call is every few milliseconds (a wake-up per push cost the GIL)."""
        self._waiting_for_more = True
        if self.rounds.intake.urgent_since == math.inf:  # one queued between the caller's look and the flag
            self._wake.wait(min(timeout, FULLNESS_POLL_S))
        self._wake.clear()
        self._waiting_for_more = False

    def _sleep(self, timeout: float | None) -> None:
        """Wait until a push sets the event, or ``timeout`` seconds."""
        self._sleeping = True
        intake = self.rounds.intake
        if not intake.pending and not intake.stopping:  # a push between the caller's look and the flag
            self._wake.wait(timeout)
        self._wake.clear()
        self._sleeping = False


class LoopDriver:
    """Runs ``rounds``' engine calls on an asyncio event loop's thread, bound by :meth:`bind` (the
    first loop that pushes; once it has closed, the next one)."""

    def __init__(self, rounds: BatchRounds) -> None:
        self.rounds = rounds
        self.loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self.carried: list = []  # a stream's later requests wait for its earlier one
        self.queued_calls: deque[tuple] = deque()  # (round's requests on its last call, chunk, call)
        self.in_flight: deque[tuple] = deque()  # (round's requests or None, chunk, wait, ready)
        self._pump_scheduled = False
        self._wait_timer: asyncio.TimerHandle | None = None
        self._sweep_timer: asyncio.TimerHandle | None = None

    @property
    def busy(self) -> bool:
        """Work queued or in flight on the bound loop."""
        return bool(self.rounds.intake.pending or self.carried or self.queued_calls or self.in_flight)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run the engine calls on ``loop`` (called on its thread)."""
        if self.loop is not None:  # moving on from a closed loop: its timers go with it
            self.cancel_timers()
            self._pump_scheduled = False
        self.loop, self._loop_thread = loop, threading.get_ident()
        self.rounds.bind_thread()
        if self.rounds.idle_timeout:
            self._sweep_timer = loop.call_later(self.rounds.idle_timeout / 4, self._sweep)

    def notify(self) -> None:
        """A request was queued: schedule the pump on the loop."""
        loop = self.loop
        if loop is None or self._pump_scheduled or loop.is_closed():
            return  # no loop yet, or its loop has closed: the next loop's first push (or close()) takes it
        if threading.get_ident() == self._loop_thread:
            self._pump_scheduled = True
            loop.call_soon(self._pump)
        else:  # a release from another thread
            try:
                loop.call_soon_threadsafe(self.notify)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def stop(self) -> None:
        """Run what is queued, then drop the loop's timers (closing; from any thread)."""
        self.cancel_timers()
        running = self.loop is not None and self.loop.is_running()
        if running and threading.get_ident() != self._loop_thread:  # closed from another thread
            done = Future()

            def drain() -> None:  # on the loop; an error reaches close()'s caller instead of hanging it
                try:
                    done.set_result(self._drain())
                except BaseException as error:  # noqa: BLE001 - handed on as it is
                    done.set_exception(error)
            self.loop.call_soon_threadsafe(drain)
            done.result()
        else:
            self._drain()

    def cancel_timers(self) -> None:
        """Drop the loop's timers (max_wait_ms, idle release): closing, or moving to another loop."""
        for timer in (self._wait_timer, self._sweep_timer):
            if timer is not None:
                timer.cancel()
        self._wait_timer = self._sweep_timer = None

    def _pump(self) -> None:
        """Deliver the calls whose copies landed (oldest first: one CUDA stream, they land in order),
        launch calls while fewer than two are in flight, and while any is in flight, look again after
        the loop's other callbacks (the pushes they queue go into the next call)."""
        self._pump_scheduled = False
        rounds = self.rounds
        try:
            while True:
                while self.in_flight and self.in_flight[0][3]():
                    rounds.timed(rounds.land, self.in_flight.popleft())
                if len(self.in_flight) >= 2 or not (self.queued_calls or self._take_round()):
                    break
                self._launch_next()
        except Exception as error:  # noqa: BLE001 - a bug of ours: fail what waits rather than hang every stream
            self._fail(error)
            raise
        if self.in_flight or self.queued_calls:
            self._pump_scheduled = True
            self.loop.call_soon(self._pump)

    def _take_round(self) -> bool:
        """Form the next round's engine calls from what is pending (a stream once a round); with
        ``max_wait_ms``, only once enough is pending or the first pending push has waited that long.
        Returns whether calls were formed."""
        rounds, intake = self.rounds, self.rounds.intake
        while intake.pending or self.carried:
            if intake.wants_more(self.carried):
                left = intake.deadline() - time.monotonic()
                if left > 0:
                    if self._wait_timer is None:
                        self._wait_timer = self.loop.call_later(left, self._wait_over)
                    return False
            taken = intake.take()
            now, self.carried = rounds.split_round(self.carried + taken if self.carried else taken)
            calls = rounds.calls(now)
            if not calls:  # releases and dropped pushes only: done now
                rounds.mark_done(now, time.monotonic())
                continue
            self.queued_calls.extend((None, chunk, call) for chunk, call in calls[:-1])
            self.queued_calls.append((now, *calls[-1]))
            return True
        return False

    def _launch_next(self) -> None:
        """Launch the oldest formed call; it joins the calls in flight."""
        round_requests, chunk, call = self.queued_calls.popleft()
        self.in_flight.append((round_requests, *self.rounds.timed(self.rounds.launch, chunk, call)))

    def _drain(self) -> None:
        """Run everything queued to the end, waiting for each call (closing)."""
        while self.in_flight or self.queued_calls or self._take_round():
            if self.in_flight:
                self.rounds.timed(self.rounds.land, self.in_flight.popleft())
            else:
                self._launch_next()

    def _wait_over(self) -> None:
        self._wait_timer = None
        self.notify()

    def _sweep(self) -> None:
        if self.rounds.closed:
            return
        self.rounds.release_idle()
        self._sweep_timer = self.loop.call_later(self.rounds.idle_timeout / 4, self._sweep)

    def _fail(self, error: Exception) -> None:
        """Fail every request formed or in flight (a request failed twice gets the first error)."""
        held = [r for entry in self.in_flight for r in entry[1]] + [r for entry in self.queued_calls for r in entry[1]]
        held += self.carried
        self.in_flight.clear(), self.queued_calls.clear(), self.carried.clear()
        self.rounds.fail(held, error)
