"""The coordinator's side of background verification: which checkpoint is verified next.

The verifier itself (:mod:`raycheckpoint.verifier`, a Ray actor that reads tensors) is
handed in as a ``start(spec)`` function by the manager that starts the coordinator: this
layer never imports the tensor path.

What the verifier answers is recorded, passed or failed, through
:meth:`RootState.record_verification <raycheckpoint.protocol.root.RootState.record_verification>`:
a checkpoint whose own bytes are bad is an answer (``ok: False``), which ``auto`` resume
and retention then honour.  A verification that could not run records nothing, and the
checkpoint stays unverified: the verifier raised (the store could not be read: see
:func:`raycheckpoint.verifier.could_not_run`), died, did not answer within the timeout,
or could not be started.  Each is logged as such; a verifier that died, hung or never
started is replaced by a fresh one for the next checkpoint.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from raycheckpoint.protocol.root import RootState
from raycheckpoint.storage import StorageSpec

logger = logging.getLogger(__name__)


class VerificationQueue:
    """The coordinator's side: checkpoints due for verification, one verified at a time.

    A checkpoint that falls due while another is verified waits; a newer one due replaces
    it (the newest is what matters).  Results are recorded on storage under
    ``commit_lock`` (never for a checkpoint deleted meanwhile) and kept for :meth:`take`.
    """

    def __init__(self, spec: StorageSpec, root: RootState, commit_lock: threading.Lock, *,
                 timeout_s: float, start: Callable[[StorageSpec], Any] | None) -> None:
        self.spec, self.root, self.commit_lock, self.timeout_s = spec, root, commit_lock, timeout_s
        self.start = start
        self._cond = threading.Condition()
        self._actor: Any = None
        self._next: str | None = None
        self._running = False
        self._results: list[dict[str, Any]] = []

    def due(self, name: str) -> None:
        if self.start is None:
            raise RuntimeError("verification is due but this coordinator was given no verifier")
        with self._cond:
            self._next = name
            if self._running:
                return
            self._running = True
        threading.Thread(target=self._loop, daemon=True, name="raycheckpoint-verify").start()

    def take(self) -> list[dict[str, Any]]:
        with self._cond:
            taken, self._results = self._results, []
        return taken

    def wait_idle(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._running, timeout)

    def _loop(self) -> None:
        import ray

        while True:
            with self._cond:
                name, self._next = self._next, None
                if name is None:
                    self._running = False
                    self._cond.notify_all()
                    return
            try:
                if self._actor is None:
                    self._actor = self.start(self.spec)
                result = ray.get(self._actor.verify.remote(name), timeout=self.timeout_s)
            except Exception as e:  # noqa: BLE001 - the verification could not run (logged)
                raised = isinstance(e, ray.exceptions.RayTaskError)
                logger.warning("background verification of %s could not run, nothing is "
                               "recorded for it: %s", name, self._why_not_run(e))
                if not raised:  # died, hung or never started: a fresh verifier next time
                    self._drop_actor()
                continue
            with self.commit_lock:
                try:
                    recorded = self.root.record_verification(name, result)
                except Exception:
                    logger.exception("recording the verification of %s failed", name)
                    recorded = False
            if recorded:
                with self._cond:
                    self._results.append(result)

    def _why_not_run(self, e: Exception) -> str:
        import ray

        if isinstance(e, ray.exceptions.RayTaskError):
            cause = getattr(e, "cause", None) or e
            return f"the verifier raised {type(cause).__name__}: {cause}"
        if isinstance(e, ray.exceptions.RayActorError):
            return f"the verifier died ({e})"
        if isinstance(e, ray.exceptions.GetTimeoutError):
            return f"the verifier did not answer within {self.timeout_s:.0f}s"
        return f"the verifier could not be started or reached ({type(e).__name__}: {e})"

    def _drop_actor(self) -> None:
        """End the current verifier (one that hangs would hold its memory) and forget it."""
        import ray

        actor, self._actor = self._actor, None
        if actor is None:
            return
        try:
            ray.kill(actor, no_restart=True)
        except Exception as e:  # noqa: BLE001 - it is gone already, or Ray is shutting down
            logger.debug("ending the verifier: %s", e)
