"""Helpers shared by the Ray integration tests."""

from __future__ import annotations

from typing import Any

import ray
import torch

from raycheckpoint import CheckpointConfig, CheckpointManager

RPC_TIMEOUT = 120

# text blocks (tables, figures) printed at the end of the pytest run, after the results
REPORTS: list[str] = []


def train(group: list[Any], seeds) -> list[float]:
    losses = []
    for seed in seeds:
        losses = ray.get([w.train_step.remote(seed) for w in group], timeout=RPC_TIMEOUT)
    return losses


def full_state(group: list[Any]) -> dict[str, Any]:
    return ray.get([w.full_state.remote() for w in group], timeout=RPC_TIMEOUT)[0]


def weights_sha(group: list[Any]) -> str:
    return ray.get([w.weights_sha256.remote() for w in group], timeout=RPC_TIMEOUT)[0]


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Bitwise equality of nested state (tensors compared with torch.equal)."""
    if isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys differ {set(a) ^ set(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"{path}: tensors differ"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def flip_bit(path: str, mask: int = 0x01) -> None:
    """Flip a bit in the middle of a file (size unchanged), as a storage fault would."""
    import os

    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ mask]))


def manager(root: str, groups: dict[str, list[Any]], options: dict | None = None,
            **kwargs: Any) -> CheckpointManager:
    settings = {"commit_timeout_s": 60, "save_wait_timeout_s": 120, "rpc_timeout_s": RPC_TIMEOUT,
                **kwargs.pop("config", {})}
    cfg = CheckpointConfig(save_dir=root, storage_options=options or {}, **settings)
    return CheckpointManager(cfg, groups, **kwargs)


def a_failed_save_then_a_whole_one(m: CheckpointManager, group: list[Any], root: str,
                                   point: str, match: str, beside: Any = None) -> None:
    """Save step 1; with ``point`` raising on rank 1, save step 2 (calling ``beside()``
    while it runs), which must fail with an error matching ``match`` within 30 s; then
    step 3 must commit within 30 s, and step 2 is never committed."""
    import time

    import pytest

    from raycheckpoint import CheckpointSaveError, Storage
    from raycheckpoint.protocol.paths import COMMITTED, LATEST

    m.update(step=1)
    m.save_checkpoint().wait(120)
    arm(group, point, "raise", ranks=[1])
    try:
        m.update(step=2)
        t0 = time.monotonic()
        with pytest.raises(CheckpointSaveError, match=match):
            handle = m.save_checkpoint()
            if beside is not None:
                beside()
            handle.wait(120)
        assert time.monotonic() - t0 < 30, "the failed save waited for a timeout"
    finally:
        disarm(group)
    m.update(step=3)
    t0 = time.monotonic()
    assert m.save_checkpoint().wait(120)["name"] == "step_00000003"
    assert time.monotonic() - t0 < 30, "the next save waited for the failed one's peer"
    st = Storage(root)
    assert not st.exists(f"step_00000002/{COMMITTED}")
    assert st.read_bytes(LATEST).decode().strip() == "step_00000003"


def arm(group: list[Any], point: str, action: str = "raise", ranks=None) -> None:
    targets = group if ranks is None else [group[r] for r in ranks]
    ray.get([w.arm_fault.remote(point, action) for w in targets], timeout=RPC_TIMEOUT)


def disarm(group: list[Any]) -> None:
    ray.get([w.disarm_faults.remote() for w in group], timeout=RPC_TIMEOUT)


@ray.remote(num_cpus=0)
class Reports:
    """A coordinator stand-in for workers called in one process: it keeps the reports
    their persists send (``take`` hands them over, with each file's path; ``entries``
    gives one save's file entries, as the manifest would list them)."""

    def __init__(self) -> None:
        self.reports: list[tuple] = []

    def report(self, save_id, role, rank, files, error, persist_s) -> None:
        self.reports.append((save_id, role, rank, files, error))

    def take(self) -> list[tuple]:
        reports, self.reports = self.reports, []
        return [(s, role, rank, [f["path"] for f in files], error)
                for s, role, rank, files, error in reports]

    def entries(self, save_id: str) -> tuple[list[dict], str | None]:
        """The file entries and the error of save ``save_id``'s (last) report."""
        for s, _, _, files, error in reversed(self.reports):
            if s == save_id:
                return files, error
        raise KeyError(save_id)


class TinyWorker:
    """In one process (no Ray actor): a small MLP with AdamW, its optimizer state built by
    one step, set up as rank 0 of role ``actor``; for tests that call the
    :class:`~raycheckpoint.worker.CheckpointableWorker` methods directly."""

    def __init__(self, root: str, guard: bool = False, coordinator: Any = None) -> None:
        from torch import nn

        from raycheckpoint.storage import StorageSpec

        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
        self.optim = torch.optim.AdamW(self.net.parameters(), lr=0.05)
        self.ckpt_setup(role="actor", rank=0, world_size=1, storage=StorageSpec(root),
                        coordinator=coordinator)
        if guard:
            self.ckpt_guard(self.optim)
        self.step()  # the optimizer state exists

    def step(self) -> None:
        loss = self.net(torch.randn(16, 32)).pow(2).mean()
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        self.optim.step()

    def ckpt_state_dict(self, kind: str) -> dict:
        return {"model": self.net.state_dict(), "optim": self.optim.state_dict()}

    def ckpt_load_state_dict(self, state: dict, kind: str) -> None:
        raise AssertionError("not loaded here")

    def staged(self) -> dict:
        """The host buffers of the last full snapshot."""
        return self._saver().stager._buffers["full"][1]


def run_job_in_process(opts: dict[str, Any]) -> list[dict[str, Any]]:
    """The RL job's ``Trainer`` with ``opts`` on this process's Ray, to its end; its
    workers killed after; the records of its ``metrics.jsonl`` (on local disk)."""
    import json
    import os

    from drivers.main_ppo import Trainer

    trainer = Trainer(opts)
    trainer.start()
    try:
        assert trainer.run() == 0
    finally:
        trainer.manager.close(RPC_TIMEOUT)
        for ws in trainer.groups.values():
            for w in ws:
                ray.kill(w)
    with open(os.path.join(trainer.root, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]
