"""Reading the checkpoint verl's own FSDPCheckpointManager writes under FSDP2: whole
tensors from every rank's DTensor shards, bit for bit, and a clear refusal of what is
not read (FSDP1, a file that needs code to unpickle, a missing or inconsistent rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from raycheckpoint.integrations.verl.checkpoint_files import VerlCheckpointError, read_role
from workers.group import free_port

REPO = Path(__file__).resolve().parents[1]
# 48 s of spawned gloo ranks: with the long tests (the default suite keeps within its 15
# minutes on a 2-core machine; .ci/run runs both)
pytestmark = [pytest.mark.long, pytest.mark.timeout(300)]


def write_role(out: Path, world: int, mesh: str | None = None) -> dict:
    out.mkdir(parents=True)
    args = [sys.executable, "-m", "tests.verl_files_ranks", str(out), str(world), str(free_port())]
    subprocess.run(args + ([mesh] if mesh else []), cwd=REPO, check=True, timeout=240)
    return torch.load(out / "expected.pt", weights_only=True)


def assert_same(a, b) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("world, mesh", [(2, None), (3, None), (4, "2x2")],
                         ids=["fsdp2", "fsdp3-uneven", "hsdp-2x2"])
def test_a_role_reads_whole_bit_for_bit(tmp_path, world, mesh):
    expected = write_role(tmp_path / "actor", world, mesh)
    role = read_role(str(tmp_path / "actor"))
    assert (role.world_size, role.fsdp_version) == (world, 2)
    assert list(role.model) == list(expected["model"])
    for k, v in expected["model"].items():
        assert_same(role.model[k], v)
    by_index = dict(enumerate(expected["names"]))
    assert role.params == expected["names"]  # what the optimizer's indices are
    assert sorted(role.optimizer["state"]) == list(by_index)
    for i, state in role.optimizer["state"].items():
        for k, v in expected["optim"]["state"][by_index[i]].items():
            assert_same(state[k], v)
    assert role.optimizer["param_groups"][0]["lr"] == expected["optim"]["param_groups"][0]["lr"]
    assert role.extra["lr_scheduler"]["last_epoch"] == 2
    assert [r["cpu"][:8].tolist() for r in role.rank_rng] != [role.rank_rng[0]["cpu"][:8].tolist()] * world


def test_what_is_not_read_is_refused_naming_the_file(tmp_path):
    write_role(tmp_path / "actor", 2)
    actor = tmp_path / "actor"
    shard = actor / "model_world_size_2_rank_1.pt"
    data = torch.load(shard, weights_only=True)

    class Payload:
        def __reduce__(self):
            return (os.system, ("true",))

    torch.save({**data, "evil": Payload()}, shard)
    with pytest.raises(VerlCheckpointError, match=r"model_world_size_2_rank_1\.pt: holds more"):
        read_role(str(actor))
    shard.unlink()
    with pytest.raises(VerlCheckpointError, match=r"model_world_size_2_rank_1\.pt: missing"):
        read_role(str(actor))
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 1, "world_size": 2}))
    with pytest.raises(VerlCheckpointError, match="FSDP1"):
        read_role(str(actor))
    (actor / "fsdp_config.json").unlink()
    with pytest.raises(VerlCheckpointError, match=r"fsdp_config\.json: missing"):
        read_role(str(actor))
