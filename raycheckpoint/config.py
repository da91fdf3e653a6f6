"""CheckpointConfig: every option of a job's checkpointing, validated once.

The config is a frozen keyword-only dataclass.  :meth:`CheckpointConfig.from_dict`
accepts the names used in the seeds' ``checkpoint_config`` dicts as written
(``save_interval``, ``keep_best_n`` ...) and verl-style dotted keys
(``trainer.save_freq``, ``trainer.default_local_dir`` ...); :data:`ALIASES` is the
one table mapping them.  Environment overrides live in :func:`env_overrides` only.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from raycheckpoint.integrity import digest
from raycheckpoint.policy.retention import RetentionRules

ResumeMode = Literal["auto", "disable", "path"]

# the smallest host_buffer_bytes accepted: below it a save is mostly per-chunk overhead
MIN_HOST_BUFFER_BYTES = 64 << 10

# Alternative spellings accepted by from_dict -> canonical field name.
ALIASES: dict[str, str] = {
    "checkpoint_dir": "save_dir",
    "trainer.default_local_dir": "save_dir",
    "trainer.save_freq": "save_full_interval",
    "trainer.max_actor_ckpt_to_keep": "keep_last_n",
    "trainer.resume_mode": "resume_mode",
    "trainer.resume_from_path": "resume_from",
    "resume_from_path": "resume_from",
    "trainer.debug": "debug",
}


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig(RetentionRules):
    """Options of one job's checkpointing.  See DESIGN section 5 for the rules.

    The retention options (``keep_last_n``, ``keep_last_n_light``, ``keep_best_n``,
    ``best_metric``, ``best_mode``) are those of
    :class:`~raycheckpoint.policy.retention.RetentionRules`, defined there once.
    """

    save_dir: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    job_name: str = "default"

    # triggers: evaluated by CheckpointManager.step() once per training step (see
    # policy/triggers.py); loss and reward are read from its metrics' "loss" and "reward"
    save_interval: int | None = None
    save_full_interval: int | None = None
    save_every_minutes: float | None = None
    save_on_loss_drop: float | None = None
    save_on_reward_gain: float | None = None
    save_on_train_end: bool = True
    # step() installs a SIGTERM handler: the next step saves, commits and sets should_stop
    # (False: SIGTERM is left alone)
    save_on_preemption: bool = True

    # storage: transient failures (connection drops, throttling, 5xx) are retried with
    # exponential backoff this many times per operation (see storage/base.py)
    storage_retries: int = 5
    # local storage: each shard's data files are written with O_DIRECT (no page cache: the
    # kernel neither copies nor keeps their bytes) where the filesystem allows it
    direct_io: bool = True
    # local storage, from a plan's second save: a shard's large data file, staged as one
    # block laid out as the file, is written by a thread of the worker's as soon as the
    # host copy has filled it, so its write overlaps the rank's answer and the persist's
    # start instead of following them (never the copy itself: training's blocked time)
    write_ahead: bool = True

    # integrity / security: every file's checksum is written; enable_checksum=False skips
    # checking the shards' checksums on load (sizes and metadata are always checked).
    # checksum_algorithm "blake3" (format 2) or "sha256" (format 1's: such checkpoints
    # stay readable by releases that read format 1); see integrity/digest.py
    enable_checksum: bool = True
    checksum_algorithm: str = "blake3"
    encryption_key: str | None = None

    # resume
    resume_mode: ResumeMode = "auto"
    resume_from: str | None = None
    allow_reshard: bool = True  # False: a changed world size is a config mismatch
    # print a resume report (which checkpoint, which checks ran, what each role loaded,
    # what was skipped and why) when a checkpoint is loaded
    debug: bool = False

    # background verification (see verify.py): every verify_every-th committed save (or
    # every one with verify_after_save) is re-read from storage by a process that is not
    # a writer: every checksum, the DCP metadata, and each role's tensors deserialized
    verify_every: int | None = None
    verify_after_save: bool = False

    # job isolation (see protocol/lease.py): one job writes a root at a time
    lease: bool = True
    lease_ttl_s: float = 30.0
    lease_takeover: bool = False
    lease_wait_s: float | None = None  # default: lease_ttl_s + 5 (a crashed holder goes stale)

    # background persist: how many nice levels below its worker each persist thread runs
    # (0: level with training; at most 19, and Ray starts workers at 15), so training
    # threads win the CPU when a host is short of cores
    persist_nice: int = 10
    # overlap the host copy with the next step's forward/backward: workers that guard
    # their optimizer (CheckpointableWorker.ckpt_guard) answer the snapshot before the
    # copy, and the optimizer step waits for what is left of it
    overlap_copy: bool = False
    # bound on the host memory one rank's save may take (bytes; None: unbounded, a host
    # copy of the whole shard).  A rank whose state holds more tensor bytes than this
    # stages no copy: its snapshot writes the tensors through a buffer of this size, a
    # chunk at a time, and training stays blocked until the last chunk is written (the
    # same files; with overlap_copy such a rank falls back to this blocking path)
    host_buffer_bytes: int | None = None
    # gc.freeze() in each worker once checkpointing is set up: the objects alive then
    # (imports, model, optimizer) leave the cyclic GC's full collections.  A full
    # collection stops every thread of a worker (training too) for ~0.16 s in the
    # benchmark's workers, and saves and loads create enough objects to set one off about
    # every other save; frozen, it takes ~0.015 s.  Cyclic garbage among the frozen
    # objects is never collected (gc.unfreeze() undoes it).
    freeze_gc: bool = True

    # monitoring (see metrics.py): Ray metrics, and warnings on abnormal growth
    publish_metrics: bool = True
    anomaly_window: int = 10
    stall_warn_factor: float = 3.0
    size_warn_factor: float = 1.5
    slow_warn_factor: float = 3.0  # persist and commit times (slow storage)

    # tiers (DESIGN section 7): with local_dir set, every save is written and committed
    # there first (a fast disk; the same path on every node), and every replicate_every-th
    # committed checkpoint (tagged ones, those of train end and preemption always) is
    # copied to save_dir, the durable tier, in the background, verified there against its
    # manifest and only then committed there (protocol/replicate.py).  The local tier keeps
    # the newest keep_last_n_local checkpoints, and those still waiting for replication,
    # up to replication_backlog of them; past that, saves go on and a warning says
    # replication is behind.  memory_replicas=R (needs local_dir) also keeps the newest
    # full checkpoint in host memory: each rank's files on its own node and on the next R
    # nodes of the job's ring, so that losing R nodes loses no shard (protocol/memory.py).
    local_dir: str | None = None
    # local_dir_per_node: local_dir is each node's own disk (the ranks of a node write
    # there; the coordinator commits on every node through per-node agents:
    # protocol/nodes.py); "{node_id}" in local_dir becomes the node's Ray id
    local_dir_per_node: bool = False
    replicate_every: int = 1
    keep_last_n_local: int = 2
    replication_backlog: int = 4
    memory_replicas: int = 0
    # the memory tier's holders and the per-node directories' agents are detached actors
    # (they outlive a crashed driver, so a restarted job finds them); one that no job has
    # used (a copy, a read, a live job's keep-alive) for this many seconds ends itself,
    # returning its memory to the cluster
    memory_idle_ttl_s: float = 3600.0

    # timeouts (seconds)
    commit_timeout_s: float = 600.0
    save_wait_timeout_s: float = 1800.0
    rpc_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.save_dir:
            raise ValueError("save_dir must name a directory or URI, got an empty string")
        for name in ("save_interval", "save_full_interval", "verify_every", "replicate_every",
                     "keep_last_n_local", "replication_backlog"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        super().__post_init__()  # the retention options
        self._check_tiers()
        if self.checksum_algorithm not in digest.ALGORITHMS:
            raise ValueError(f"checksum_algorithm must be one of {digest.ALGORITHMS}, got "
                             f"{self.checksum_algorithm!r}")
        if self.resume_mode not in ("auto", "disable", "path"):
            raise ValueError(
                f"resume_mode must be 'auto', 'disable' or 'path', got {self.resume_mode!r}")
        if self.resume_mode == "path" and not self.resume_from:
            raise ValueError("resume_mode='path' needs resume_from (a path, step or tag)")
        if self.encryption_key is not None and not self.encryption_key.startswith(("env:", "file:")):
            raise ValueError(
                "encryption_key must be a reference such as 'env:NAME' or 'file:PATH'; "
                "a literal secret in a config is refused")
        if self.host_buffer_bytes is not None and (
                isinstance(self.host_buffer_bytes, bool) or not isinstance(self.host_buffer_bytes, int)
                or self.host_buffer_bytes < MIN_HOST_BUFFER_BYTES):
            raise ValueError(
                f"host_buffer_bytes must be an integer of at least {MIN_HOST_BUFFER_BYTES} "
                f"bytes (64 KiB), or None for no bound; got {self.host_buffer_bytes!r}")
        if not 0 <= self.persist_nice <= 19:
            raise ValueError(f"persist_nice must be within 0..19, got {self.persist_nice}")
        if self.storage_retries < 0:
            raise ValueError(f"storage_retries must be >= 0, got {self.storage_retries!r}")
        if self.anomaly_window < 1:
            raise ValueError(f"anomaly_window must be >= 1, got {self.anomaly_window!r}")
        for name in ("commit_timeout_s", "save_wait_timeout_s", "rpc_timeout_s",
                     "stall_warn_factor", "size_warn_factor", "slow_warn_factor",
                     "lease_ttl_s", "memory_idle_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")

    def _check_tiers(self) -> None:
        if not isinstance(self.memory_replicas, int) or self.memory_replicas < 0:
            raise ValueError("checkpoint.memory_replicas must be a non-negative integer, got "
                             f"{self.memory_replicas!r}")
        if self.local_dir_per_node and self.local_dir is None:
            raise ValueError("checkpoint.local_dir_per_node needs checkpoint.local_dir")
        if self.memory_replicas and self.local_dir is None:
            raise ValueError("checkpoint.memory_replicas needs checkpoint.local_dir: the memory "
                             "tier copies the checkpoints committed in the local tier")
        if self.local_dir is not None:
            if not self.local_dir or "://" in self.local_dir.removeprefix("file://"):
                raise ValueError("checkpoint.local_dir must be a directory on the nodes' own "
                                 f"disks, got {self.local_dir!r}")
            local = os.path.abspath(os.path.expanduser(self.local_dir.removeprefix("file://")))
            durable = self.save_dir.removeprefix("file://")
            if "://" not in durable:
                durable = os.path.abspath(os.path.expanduser(durable))
                if (os.path.commonpath([local, durable]) in (local, durable)):
                    raise ValueError(f"checkpoint.local_dir ({self.local_dir}) and save_dir "
                                     f"({self.save_dir}) must not contain one another")

    @property
    def tiered(self) -> bool:
        """True when saves go to ``local_dir`` first and are replicated to ``save_dir``."""
        return self.local_dir is not None

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> CheckpointConfig:
        """Build a config from a dict of canonical names, seed names or verl dotted keys."""
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        unknown = []
        for key, value in options.items():
            name = ALIASES.get(key, key.removeprefix("checkpoint."))
            if name not in known:
                unknown.append(key)
                continue
            if name == "resume_mode" and value == "resume_path":  # verl spelling
                value = "path"
            kwargs[name] = value
        if unknown:
            names = sorted(known | set(ALIASES))
            hints = []
            for key in sorted(unknown):
                close = difflib.get_close_matches(key.removeprefix("checkpoint."), names, n=3,
                                                  cutoff=0.6)
                hints.append(f"{key!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
            raise ValueError(f"unknown checkpoint option(s): {'; '.join(hints)}. "
                             f"Known: {', '.join(names)}")
        kwargs.update(env_overrides())
        return cls(**kwargs)

    @property
    def verify_interval(self) -> int | None:
        """Verify every this many committed saves (None: never)."""
        return 1 if self.verify_after_save else self.verify_every

    def replace(self, **changes: Any) -> CheckpointConfig:
        return dataclasses.replace(self, **changes)


def env_overrides() -> dict[str, Any]:
    """The only place environment variables change a config."""
    out: dict[str, Any] = {}
    if "RAYCHECKPOINT_SAVE_DIR" in os.environ:
        out["save_dir"] = os.environ["RAYCHECKPOINT_SAVE_DIR"]
    return out
