"""Staging a snapshot: one walk over the state into the reused host buffers.

A saver stages each save with one walk against the structure it saw last
(``raycheckpoint._internal.staging.Staging``); any difference in structure, shape, dtype or leaf kind must
make it build anew, and a tensor replaced by another of the same layout must be copied
from its own memory, never from the memory of the tensor it replaced.  DTensor
placements are checked on real FSDP2 ranks in ``test_dcp_save.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import raycheckpoint._internal.staging as staging_module
from raycheckpoint._internal.shard_saver import ShardSaver
from raycheckpoint.storage import StorageSpec


@dataclasses.dataclass
class Note:  # a leaf that is neither a tensor nor immutable: staged as a copy
    text: str


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(8, 4, generator=g), "b": torch.randn(4, generator=g)},
            "optim": {"state": {"w": {"step": torch.tensor(1.0),
                                      "exp_avg": torch.randn(8, 4, generator=g)}},
                      "param_groups": [{"lr": 0.01, "betas": (0.9, 0.99), "foreach": None,
                                        "params": ["w", "b"]}]},
            "note": Note("a")}


def _assert_staged(staged, state) -> None:
    """``staged`` holds ``state``'s values in memory of its own, structure for structure."""
    if isinstance(state, dict):
        assert isinstance(staged, dict) and staged.keys() == state.keys()
        for k in state:
            _assert_staged(staged[k], state[k])
    elif isinstance(state, (list, tuple)):
        assert type(staged) is type(state) and len(staged) == len(state)
        assert staged is not state or isinstance(state, tuple)  # a list of its own
        for a, b in zip(staged, state, strict=True):
            _assert_staged(a, b)
    elif isinstance(state, torch.Tensor):
        assert staged.dtype == state.dtype and staged.shape == state.shape
        assert torch.equal(staged, state)
        assert staged.data_ptr() != state.data_ptr()
    else:
        assert staged == state
        if not isinstance(state, (str, int, float, bool, type(None))):
            assert staged is not state


@pytest.fixture
def saver(tmp_path):
    return ShardSaver(role="actor", rank=0, world_size=1, storage=StorageSpec(str(tmp_path)))


@pytest.fixture
def signatures(monkeypatch):
    """How many times a saver walked a state for its signature (= built its staging)."""
    calls = []
    real = staging_module.signature

    def counted(obj, prefix=""):
        if not prefix:
            calls.append(1)
        return real(obj, prefix)

    monkeypatch.setattr(staging_module, "signature", counted)
    return calls


def test_later_saves_stage_into_the_same_buffers_with_one_walk(saver, signatures):
    state = _state()
    first = saver.stager.stage("full", state)
    _assert_staged(first, state)
    built = len(signatures)
    for i in range(3):  # training: tensors change in place, leaves change value
        state["model"]["w"].add_(1.0)
        state["optim"]["state"]["w"]["step"].add_(1.0)
        state["optim"]["param_groups"][0]["lr"] = 0.01 / (i + 2)
        state["note"].text = f"step {i}"
        staged = saver.stager.stage("full", state)
        _assert_staged(staged, state)
        assert staged["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()
        assert staged["optim"]["param_groups"][0]["lr"] == 0.01 / (i + 2)
    assert len(signatures) == built
    assert first["note"].text == "a"  # an earlier save's copy is its own


def _replace_same_layout(state):
    state["model"]["w"] = torch.randn(8, 4)  # a loaded optimizer state, say


def _swap_data(state):
    state["model"]["w"].data = torch.randn(8, 4)  # the same tensor object over new memory


@pytest.mark.parametrize("change", [_replace_same_layout, _swap_data],
                         ids=["same-layout-tensor", "same-object-new-memory"])
def test_a_tensor_over_new_memory_is_copied_from_that_memory(saver, signatures, change):
    state = _state()
    first = saver.stager.stage("full", state)
    built = len(signatures)
    change(state)
    staged = saver.stager.stage("full", state)
    _assert_staged(staged, state)
    assert staged["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()  # same buffer
    assert len(signatures) == built  # no new buffers for the same layout


def _new_key(s): s["model"]["extra"] = torch.zeros(3)
def _lost_key(s): del s["model"]["b"]
def _renamed_key(s): s["model"]["c"] = s["model"].pop("b")
def _reshaped(s): s["model"]["w"] = torch.randn(4, 8)
def _retyped(s): s["model"]["w"] = s["model"]["w"].to(torch.bfloat16)
def _leaf_to_tensor(s): s["optim"]["param_groups"][0]["lr"] = torch.tensor(0.5)
def _tensor_to_dict(s): s["model"]["b"] = {"inner": torch.zeros(4)}
def _longer_list(s): s["optim"]["param_groups"][0]["params"].append("c")
def _tuple_to_list(s): s["optim"]["param_groups"][0]["betas"] = [0.9, 0.99]
def _list_to_value(s): s["optim"]["param_groups"][0]["params"] = "w,b"


@pytest.mark.parametrize("change", [
    _new_key, _lost_key, _renamed_key, _reshaped, _retyped, _leaf_to_tensor, _tensor_to_dict,
    _longer_list, _tuple_to_list, _list_to_value])
def test_a_changed_structure_is_staged_anew(saver, signatures, change):
    state = _state()
    saver.stager.stage("full", state)
    built = len(signatures)
    change(state)
    staged = saver.stager.stage("full", state)
    _assert_staged(staged, state)
    assert len(signatures) > built
    rebuilt = len(signatures)
    again = saver.stager.stage("full", state)  # and the new structure is the one kept
    _assert_staged(again, state)
    assert len(signatures) == rebuilt


def test_light_and_full_share_buffers_and_keep_their_own_staging(saver):
    state = _state()
    full = saver.stager.stage("full", state)
    light = saver.stager.stage("light", {"model": state["model"]})
    assert light["model"]["w"].data_ptr() == full["model"]["w"].data_ptr()
    state["model"]["w"].add_(1.0)
    _assert_staged(saver.stager.stage("light", {"model": state["model"]}), {"model": state["model"]})
    _assert_staged(saver.stager.stage("full", state), state)
