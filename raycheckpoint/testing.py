"""Hooks for testing a job built on raycheckpoint: named fault points.

The library checks a named point at each step of the save protocol; a test arms one in
the process it should fail in, and the real code path then raises, hangs or dies there:

=================================  ===================================================
point                              where
=================================  ===================================================
``worker.snapshot``                a worker, before its host copy
``worker.copy``                    an overlapped host copy, in its thread
``worker.begin_answer``            a worker reading the coordinator's ``begin`` answer
``worker.persist``                 a persist thread, before it writes
``worker.before_report``           a persist thread, its files written, not reported
``storage.write``                  any file write (``@path-substring`` narrows it)
``storage.pointer``                replacing ``LATEST``, a tag, the catalog, the lease
``storage.marker``                 creating ``COMMITTED`` or the lease
``storage.delete``                 deleting a file or a step directory
``coordinator.trainer_state``      the commit, before ``trainer_state.json``
``coordinator.manifest``           the commit, before the manifest
``coordinator.before_marker``      the commit, before ``COMMITTED``
``coordinator.after_marker``       the commit, after ``COMMITTED``, before ``LATEST``
``coordinator.catalog``            the commit, before ``catalog.json``
``coordinator.retention_delete``   retention, before deleting a checkpoint
``verifier.verify``                the background verifier, before it reads a checkpoint
``replicate.file``                 replication to the durable tier, before copying a file
``replicate.verify``               replication, every file copied, before reading them back
``replicate.before_marker``        replication, verified, before ``COMMITTED`` in the target
``replicate.after_marker``         replication, after ``COMMITTED``, before ``LATEST``
``replicate.catalog``              replication, before the target's ``catalog.json``
=================================  ===================================================

Actions: ``raise`` (:class:`~raycheckpoint.errors.InjectedFault`), ``hang:<seconds>``,
``kill`` (the process exits at once, as after SIGKILL).  Arm in code with :func:`arm`
(in the process concerned: a Ray worker arms through a method of its own), or for a
whole process through ``RAYCHECKPOINT_FAULTS=point=action[,point=action]``.  Nothing
happens at an unarmed point.
"""

from raycheckpoint._internal.faults import arm, disarm
from raycheckpoint.errors import InjectedFault

__all__ = ["InjectedFault", "arm", "disarm"]
