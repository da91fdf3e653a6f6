"""Exception types raised by raycheckpoint.

Every error derives from :class:`RayCheckpointError` and also from the built-in
exception a caller would naturally catch (``FileNotFoundError``, ``TimeoutError``,
``ValueError``), so ``except FileNotFoundError`` keeps working.  All of them
survive pickling across Ray: ``__reduce__`` rebuilds them from their message and
keyword fields, so the driver sees the same type a worker or the coordinator raised.
"""

from __future__ import annotations

from typing import Any


class RayCheckpointError(Exception):
    """Base class of every raycheckpoint error."""

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields
        for key, value in fields.items():
            setattr(self, key, value)

    def __reduce__(self):
        return (_rebuild, (type(self), self.message, self.fields))

    def __str__(self) -> str:
        return self.message


def _rebuild(cls: type, message: str, fields: dict[str, Any]) -> RayCheckpointError:
    return cls(message, **fields)


class CheckpointNotFoundError(RayCheckpointError, FileNotFoundError):
    """A checkpoint reference (path, step, tag, ``latest``) names nothing committed."""


class IntegrityError(RayCheckpointError, ValueError):
    """A file of a checkpoint is missing, has the wrong size or the wrong checksum.

    ``path`` names the file (relative to the checkpoint root).
    """


class IncompatibleCheckpointError(RayCheckpointError, ValueError):
    """The checkpoint's format version cannot be read by this library."""


class ConfigMismatchError(RayCheckpointError, ValueError):
    """The current job's config fingerprint differs from the checkpoint's.

    ``differences`` lists ``(key, saved, current)`` triples.
    """


class LightCheckpointError(RayCheckpointError, ValueError):
    """A strict resume was asked of a light (weights-only) checkpoint."""


class CommitTimeoutError(RayCheckpointError, TimeoutError):
    """Not every (role, rank) reported within the commit timeout.

    ``missing`` lists the ``(role, rank)`` pairs that never reported.
    """


class CheckpointSaveError(RayCheckpointError, RuntimeError):
    """A save was aborted: a worker failed, or the commit itself failed.

    ``failures`` maps ``"role/rank"`` to the error text of each failing party.
    """


class InjectedFault(RayCheckpointError, RuntimeError):
    """Raised at a named fault point armed by a test (see ``_internal.faults``)."""


class LeaseHeldError(RayCheckpointError, RuntimeError):
    """Another job holds the checkpoint root's lease (the message names it)."""


class LeaseLostError(RayCheckpointError, RuntimeError):
    """This job's lease on its checkpoint root was taken over by another job."""


class MissingDependencyError(RayCheckpointError, ImportError):
    """A package this operation needs cannot be imported here (the message says which,
    and what to do instead)."""


class StorageCapabilityError(RayCheckpointError, ValueError):
    """A root's backend cannot do safely what is asked of it: a job's ``LEASE`` or a
    ``COMMITTED`` marker on a backend without an atomic exclusive create.  ``uri`` names
    the root and ``backend`` its filesystem; the message says what to use instead."""
