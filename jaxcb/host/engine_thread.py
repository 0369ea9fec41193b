"""The engine on a thread of its own, for the server: other threads submit and abort, it steps.

The thread sleeps while there is no work and wakes when a request arrives. Failures of a single
step are handled inside the engine (the step's requests fail, the rest go on); anything that
escapes `step()` is a broken engine, so the thread records the error, calls `on_death` and stops,
and the server turns unhealthy and exits instead of accepting requests it will never answer.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from jaxcb.host.engine import Engine, EventCallback
from jaxcb.host.errors import Unavailable
from jaxcb.host.request import SamplingParams

log = logging.getLogger("jaxcb.host.engine_thread")


class EngineThread:
    def __init__(self, engine: Engine, on_death: Callable[[BaseException], None] | None = None,
                 on_step: Callable[[Engine, list], None] | None = None):
        self.engine = engine
        self.on_death = on_death
        self.on_step = on_step  # called on the engine thread after each step with its events
        self.error: BaseException | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="jaxcb-engine", daemon=True)

    def start(self) -> "EngineThread":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, prompt_ids: list[int], params: SamplingParams, callback: EventCallback, **kw) -> str:
        if not self.alive:
            raise Unavailable("the engine is not running")
        rid = self.engine.add_request(prompt_ids, params, callback=callback, **kw)
        self._wake.set()
        return rid

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    def wake(self) -> None:
        """Something was put in the engine's inbox: the loop takes it now, not at its next idle poll."""
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.engine.has_work():
                    self.engine.runner.idle()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                events = self.engine.step()
                if self.on_step is not None:
                    self.on_step(self.engine, events)
                if self.engine.last_step_idle:  # requests wait behind a closed batching window: sleep, not spin
                    self._wake.wait(max(0.001, min(0.05, self.engine.scheduler.admission_wait_s())))
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - record and report, then let the thread end
            self.error = e
            log.exception("the engine thread died")
            if self.on_death is not None:
                self.on_death(e)
