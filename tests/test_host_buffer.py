"""Host memory of a rank's save: one slab per kind of save, and ``checkpoint.host_buffer_bytes``.

The staging buffers are views into one allocation (no per-tensor rounding); a rank over
its budget writes its tensors through a bounded buffer, a chunk at a time, and the files
are what a staged save writes: they load back bitwise, verified, encrypted or not.
"""

from __future__ import annotations

import os

import pytest
import torch

from raycheckpoint._internal.bounded_write import BoundedBuffer, live_state
from raycheckpoint._internal.dcp.load import load_verified
from raycheckpoint._internal.dcp.reader import VerifyingStorageReader
from raycheckpoint._internal.dcp.save import save_state
from raycheckpoint._internal.dcp.shard_plan import ShardPlan
from raycheckpoint._internal.dcp.writer import HashingStorageWriter
from raycheckpoint._internal.persist import SaveTarget, Snapshot
from raycheckpoint._internal.shard_saver import ShardSaver
from raycheckpoint._internal.slab import SLAB_ALIGN
from raycheckpoint._internal.staging import HostStager, tensor_bytes
from raycheckpoint.config import CheckpointConfig
from raycheckpoint.errors import IntegrityError
from raycheckpoint.integrity.crypto import FileCipher
from raycheckpoint.storage import Storage, StorageSpec

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"embed": torch.randn(1024, 1024, generator=g),  # 4 MiB: over a budget
                      "w": torch.randn(300, 257, generator=g).to(torch.bfloat16),
                      "b": torch.randn(7, generator=g), "empty": torch.empty(0, 4)},
            "optim": {"state": {"w": {"step": torch.tensor(3.0),
                                      "exp_avg": torch.randn(300, 257, generator=g)}},
                      "param_groups": [{"lr": 0.01, "params": ["w"]}]},
            "note": "a note"}


def _zeros_like(state):
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_zeros_like(v) for v in state]
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return state


def _assert_equal(got, want) -> None:
    if isinstance(want, dict):
        for k in want:
            _assert_equal(got[k], want[k])
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(-1).view(torch.uint8) if got.numel() else got,
                           want.reshape(-1).view(torch.uint8) if want.numel() else want)


def test_buffers_are_views_into_one_slab():
    """One allocation per kind: every buffer's memory lies in one storage; its size is
    the tensors' bytes plus alignment (not a rounding per tensor); a light save shares
    the full save's slab; the stager says whether the buffers are pinned by asking them."""
    state = _state()
    stager = HostStager("actor/0")
    staged = stager.stage("full", state)
    buffers = list(stager.staging["full"].tensors())
    storages = {t.untyped_storage().data_ptr() for t in buffers if t.numel()}
    assert len(storages) == 1
    (slab,) = {id(s): s for s in stager.slabs.values()}.values()
    base, size = slab.flat.data_ptr(), slab.nbytes
    for t in buffers:
        if t.numel():
            assert base <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= base + size
            assert (t.data_ptr() - base) % SLAB_ALIGN == 0
    want = tensor_bytes(state)
    n = sum(1 for t in buffers if t.numel())
    assert want <= stager.host_bytes <= want + n * SLAB_ALIGN
    _assert_equal(staged, state)
    assert stager.pinned("full") is torch.cuda.is_available()
    assert stager.pinned_bytes == (stager.host_bytes if torch.cuda.is_available() else 0)

    stager.stage("light", {"model": state["model"]})  # the model part of full: shared
    assert stager.host_bytes == size
    light = {t.data_ptr() for t in stager.staging["light"].tensors() if t.numel()}
    assert light <= {t.data_ptr() for t in buffers}


def _save_bounded(storage: Storage, d: str, state: dict, budget: int) -> tuple[list, BoundedBuffer]:
    bounded = BoundedBuffer(budget, pin=False)
    bounded.begin(None)
    plan = ShardPlan()
    writer = HashingStorageWriter(storage, d, plan, None, bounded)
    save_state(live_state(state), writer, plan)
    assert bounded.released.is_set()
    return list(writer.written), bounded


def _save_staged(storage: Storage, d: str, state: dict) -> list:
    staged = HostStager("actor/0").stage("full", state)
    plan = ShardPlan()
    writer = HashingStorageWriter(storage, d, plan)
    save_state(staged, writer, plan)
    return list(writer.written)


def _load(storage: Storage, d: str, files: list, like: dict) -> dict:
    got = _zeros_like(like)
    load_verified(got, VerifyingStorageReader(storage, d, {f.path: f for f in files}))
    return got


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
def test_a_save_over_its_budget_writes_through_a_bounded_buffer(tmp_path, encrypted):
    """A save through a 1 MiB buffer (the state holds 5 MiB of tensors): the buffer is all
    the host memory it took, chunk by chunk; its files are byte for byte a staged save's
    (unencrypted), and load back bitwise equal, their checksums verified."""
    cipher = FileCipher(os.urandom(32)) if encrypted else None
    storage = Storage(str(tmp_path), cipher=cipher)
    state = _state()
    files, bounded = _save_bounded(storage, "bounded", state, MIB)
    assert tensor_bytes(state) > 4 * MIB
    assert bounded.host_bytes == MIB and bounded.peak == MIB and bounded.chunks >= 5
    staged_files = _save_staged(storage, "staged", state)
    if not encrypted:
        for f in staged_files:
            name = os.path.basename(f.path)
            with open(tmp_path / "staged" / name, "rb") as a, open(tmp_path / "bounded" / name,
                                                                    "rb") as b:
                assert a.read() == b.read(), name
    _assert_equal(_load(storage, "bounded", files, state), state)
    # a flipped byte in a data file is refused
    data = next(f for f in files if f.path.endswith("_0.distcp"))
    with open(tmp_path / data.path, "r+b") as f:
        f.seek(data.size // 2)
        byte = f.read(1)
        f.seek(data.size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(IntegrityError):
        _load(storage, "bounded", files, state)


@pytest.mark.parametrize("budget", [0, -1, 4096, (64 << 10) - 1, 1.5e6, True, "64M"])
def test_the_config_refuses_a_budget_too_small_or_not_a_number(budget, tmp_path):
    with pytest.raises(ValueError, match="host_buffer_bytes"):
        CheckpointConfig(save_dir=str(tmp_path), host_buffer_bytes=budget)
    assert CheckpointConfig(save_dir=str(tmp_path), host_buffer_bytes=MIB).host_buffer_bytes == MIB
    assert CheckpointConfig(save_dir=str(tmp_path)).host_buffer_bytes is None


class _Coordinator:
    """The coordinator's ``report``, as the persist calls it (``.remote``), kept here."""

    def __init__(self) -> None:
        self.reports: list = []
        self.report = self

    def remote(self, *args):
        import ray

        self.reports.append(args)
        return ray.put(None)


def test_the_saver_answers_with_host_figures_and_bounds_a_large_shard(tmp_path, ray_session):
    """Through the rank's saver: under the budget the snapshot stages into its slab and
    says how much host memory it holds; over it, nothing is staged, the snapshot returns
    once its tensors are written (``chunked``), holding only the buffer, and the files
    load back, verified."""
    state = _state()
    coordinator = _Coordinator()
    saver = ShardSaver(role="actor", rank=0, world_size=1, storage=StorageSpec(str(tmp_path)))
    saver.host_buffer_bytes = 64 * MIB  # over this shard: staged
    out = saver.snapshot(Snapshot("full", state), SaveTarget(coordinator, "s1", "step_1"))
    saver.pending.wait(60)
    assert out["chunked"] is False and out["host_bytes"] >= tensor_bytes(state)
    assert out["pinned_bytes"] == (out["host_bytes"] if torch.cuda.is_available() else 0)

    small = HostStager("x")  # what the budgeted save must stay under
    saver = ShardSaver(role="actor", rank=0, world_size=1, storage=StorageSpec(str(tmp_path)))
    saver.host_buffer_bytes = MIB
    out = saver.snapshot(Snapshot("full", state, extra={"rng": 1}), SaveTarget(coordinator, "s2",
                                                                                "step_2"))
    assert out["chunked"] is True and out["chunks"] >= 5
    assert out["host_bytes"] == MIB and saver.stager.host_bytes == 0
    assert saver.prepare("full", state) == 0 and saver.stager.host_bytes == small.host_bytes
    files = saver.pending.wait(60)
    assert coordinator.reports[-1][4] is None  # reported without an error
    dcp_files = [f for f in files if f.path.startswith("step_2/actor/")]
    _assert_equal(_load(saver.storage, "step_2/actor", dcp_files, state), state)


def test_checkpoint_stats_carry_each_save_host_memory(group2, local_root):
    """Through the Ray workers: a job under no budget reports the host memory its ranks'
    staging holds; one whose budget each rank's shard exceeds writes through the bounded
    buffer (``chunked``), holds at most the budget, commits, and loads back."""
    from tests.helpers import manager, train

    budget = 64 << 10
    for name, config in (("unbounded", {}), ("bounded", {"host_buffer_bytes": budget})):
        m = manager(f"{local_root}/{name}", {"actor": group2},
                    config={"job_name": f"host-{name}", **config})
        try:
            train(group2, [1])
            m.update(step=1)
            m.save_checkpoint().wait(120)
            (stats,) = m.checkpoint_stats
            assert stats["ok"] and stats["host_bytes"] > 0
            assert stats["pinned_bytes"] == (stats["host_bytes"] if torch.cuda.is_available() else 0)
            if name == "bounded":
                assert stats["chunked"] is True and stats["host_bytes"] <= budget
                assert m.load_checkpoint("latest") is not None
            else:
                assert stats["chunked"] is False and stats["host_bytes"] > budget
        finally:
            m.close(120)
