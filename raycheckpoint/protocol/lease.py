"""The job lease: one job writes a checkpoint root at a time.

``<root>/LEASE`` (JSON) names the holder: job id and name, host, pid, the boot id and
PID namespace the pid is counted in, and a heartbeat refreshed every ``ttl_s / 3``
seconds by a thread of the driver.  A second job pointed at the same root is refused
with a :class:`LeaseHeldError` naming the holder, unless

* the lease is stale (no heartbeat for ``ttl_s``: the holder died), waited for up to
  ``wait_s`` so a job restarted right after a crash resumes without a person;
* the holder's process is gone, which is known only where its pid means what it means
  here: the same host, the same boot and the same PID namespace (taken at once).  A
  holder in another container or PID namespace on a host of the same name is invisible
  to ``kill(pid, 0)`` while alive, so it is waited for until stale; so is one whose
  LEASE records no boot id or namespace (written by an older release);
* takeover is asked for explicitly (``lease_takeover=True``).

A job whose lease was taken over learns it at its next heartbeat or write: the
coordinator checks the lease before every write to the root's shared state
(``COMMITTED``, ``LATEST``, a tag, the catalog, verification results) and before
deleting anything (:class:`~raycheckpoint.protocol.root.RootState`), and fails with a
:class:`LeaseLostError` naming the new holder: a job that lost its lease writes nothing
more there.

The first lease is created exclusively (the same atomic create as ``COMMITTED``): a
root whose backend has no atomic exclusive create is refused before any lease is taken
(:mod:`~raycheckpoint.storage.atomic`).  A stale or taken-over one is replaced with one
atomic write, then read back.  Two jobs taking over the same stale lease at the same
instant are decided by that read-back; a holder whose heartbeat races a takeover keeps
its lease and the taker gets LeaseLostError at its next check.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from raycheckpoint.errors import LeaseHeldError, LeaseLostError
from raycheckpoint.protocol.paths import LEASE
from raycheckpoint.storage import Storage


@dataclass
class LeaseInfo:
    job_id: str
    job_name: str
    host: str
    pid: int
    started_at: float
    heartbeat_at: float
    ttl_s: float
    # where ``pid`` is counted ("" when unknown, as in a LEASE of an older release)
    boot_id: str = ""
    pid_ns: str = ""

    def age(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.heartbeat_at

    def fresh(self, now: float | None = None) -> bool:
        return self.age(now) < self.ttl_s

    def describe(self) -> str:
        return (f"job {self.job_name!r} (id {self.job_id}) on {self.host} pid {self.pid}, "
                f"last heartbeat {self.age():.0f}s ago (stale after {self.ttl_s:.0f}s)")

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> LeaseInfo:
        d = json.loads(data)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__
                      if k in d or k not in OPTIONAL_FIELDS})


OPTIONAL_FIELDS = ("boot_id", "pid_ns")  # absent from the LEASE of an older release


def boot_id() -> str:
    """This machine's boot id ("" where the system has none to read)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def pid_namespace() -> str:
    """This process's PID namespace, as ``pid:[<inode>]`` ("" where it cannot be read)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def read_lease(storage: Storage) -> LeaseInfo | None:
    """The current lease; None when there is none (or it is unreadable: treated as stale)."""
    try:
        return LeaseInfo.from_bytes(storage.read_bytes(LEASE))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        return LeaseInfo("unreadable", "unreadable", "?", -1, 0.0, 0.0, 0.0)


def check_held(storage: Storage, job_id: str, holder: str) -> None:
    """Raise LeaseLostError naming the new holder unless ``job_id`` holds the lease."""
    current = read_lease(storage)
    if current is None or current.job_id != job_id:
        who = current.describe() if current is not None else "nobody (the lease was removed)"
        raise LeaseLostError(f"the lease on {storage.url()} is now held by {who}; this job "
                             f"({holder}) no longer writes there",
                             holder=None if current is None else current.job_name)


def _process_gone(info: LeaseInfo) -> bool:
    """True when the holder's pid is one of this PID namespace (the same host, boot and
    namespace, each known) and no process has it."""
    here = (socket.gethostname(), boot_id(), pid_namespace())
    if (info.host, info.boot_id, info.pid_ns) != here or not all(here) or info.pid <= 0:
        return False
    try:
        os.kill(info.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class Lease:
    def __init__(self, storage: Storage, *, job_name: str, ttl_s: float = 30.0,
                 takeover: bool = False, wait_s: float | None = None) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl_s must be positive, got {ttl_s!r}")
        self.storage = storage
        self.ttl_s = ttl_s
        self.takeover = takeover
        self.wait_s = ttl_s + 5.0 if wait_s is None else wait_s
        now = time.time()
        self.info = LeaseInfo(job_id=uuid.uuid4().hex[:16], job_name=job_name,
                              host=socket.gethostname(), pid=os.getpid(), started_at=now,
                              heartbeat_at=now, ttl_s=ttl_s, boot_id=boot_id(),
                              pid_ns=pid_namespace())
        self.took_over: LeaseInfo | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: LeaseLostError | None = None

    @property
    def job_id(self) -> str:
        return self.info.job_id

    def _stamp(self) -> bytes:
        self.info.heartbeat_at = time.time()
        return self.info.to_bytes()

    def acquire(self) -> Lease:
        """Take the lease (see the module doc); raise LeaseHeldError naming the holder,
        or StorageCapabilityError for a root whose backend has no atomic exclusive create."""
        self.storage.require_atomic_create()
        deadline = time.monotonic() + self.wait_s
        while True:
            current = read_lease(self.storage)
            if current is None:
                try:
                    self.storage.create_marker(LEASE, self._stamp())
                    return self._started()
                except FileExistsError:
                    continue  # another job created it first: look again
            if current.job_id == self.job_id:
                return self._started()
            if self.takeover or not current.fresh() or _process_gone(current):
                self.storage.write_pointer(LEASE, self._stamp())
                time.sleep(0.2)  # a simultaneous taker's write lands before this read-back
                after = read_lease(self.storage)
                if after is not None and after.job_id == self.job_id:
                    self.took_over = current
                    return self._started()
                current = after or current
            if time.monotonic() >= deadline:
                raise LeaseHeldError(
                    f"checkpoint root {self.storage.url()} is in use by {current.describe()}. "
                    "One job writes a root at a time: point this job at another directory, stop "
                    "the other job, or take the lease over explicitly (checkpoint.lease_takeover"
                    "=true) if it is gone.", holder=current.job_name, holder_id=current.job_id)
            time.sleep(min(1.0, max(0.05, self.ttl_s / 10)))

    def _started(self) -> Lease:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="raycheckpoint-lease",
                                        daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        interval = self.ttl_s / 3
        while not self._stop.wait(interval):
            try:
                self.heartbeat()
            except LeaseLostError as e:
                self.lost = e
                return
            except Exception:  # noqa: BLE001 - a storage hiccup: try again next beat
                continue

    def check(self) -> None:
        """Raise LeaseLostError unless this job still holds the lease."""
        if self.lost is not None:
            raise self.lost
        try:
            check_held(self.storage, self.job_id, f"{self.info.job_name!r}, id {self.job_id}")
        except LeaseLostError as e:
            self.lost = e
            raise

    def heartbeat(self) -> None:
        self.check()
        self.storage.write_pointer(LEASE, self._stamp())

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if this job still holds it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        current = read_lease(self.storage)
        if current is not None and current.job_id == self.job_id:
            self.storage.delete(LEASE)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self.info)
