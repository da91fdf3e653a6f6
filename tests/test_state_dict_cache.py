"""StateDictCache: torch's state dicts, rebuilt only when the tensors behind them change.

Each answer is compared with what torch's ``get_model_state_dict`` and
``optimizer_state_dict`` return at that moment: the same keys, the optimizer's own
tensors and param-group values, model tensors over the parameters' storage.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from raycheckpoint.state_dict_cache import StateDictCache, _same_leaves, optimizer_state_dict


def _reference(net: nn.Module, optim: torch.optim.Optimizer) -> dict:
    with torch.no_grad():
        return {"model": get_model_state_dict(net), "optim": optimizer_state_dict(net, optim)}


def _assert_matches(got: dict, ref: dict) -> None:
    assert got["model"].keys() == ref["model"].keys()
    for k, t in ref["model"].items():
        assert torch.equal(got["model"][k], t), k
        assert got["model"][k].data_ptr() == t.data_ptr(), f"{k}: not the parameter's storage"
    assert _same_leaves(got["optim"], ref["optim"])


def _step(net: nn.Module, optim: torch.optim.Optimizer) -> None:
    loss = net(torch.randn(4, 8)).pow(2).mean()
    optim.zero_grad(set_to_none=True)
    loss.backward()
    optim.step()


def test_the_cache_follows_training_and_rebuilds_when_tensors_are_replaced():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    optim = torch.optim.AdamW(net.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LinearLR(optim, start_factor=1.0, end_factor=0.1,
                                              total_iters=10)
    cache = StateDictCache(net, optim)

    _assert_matches(cache.state_dict("full"), _reference(net, optim))  # before the first step
    assert all(float(s["step"]) == 0 for s in optim.state.values())  # no step was counted
    built = cache.builds
    for _ in range(3):  # in-place updates, a changing learning rate: read, not rebuilt
        _step(net, optim)
        sched.step()
        got = cache.state_dict("full")
        _assert_matches(got, _reference(net, optim))
    assert cache.builds == built
    assert got["optim"]["param_groups"][0]["lr"] == optim.param_groups[0]["lr"] < 0.01
    assert cache.state_dict("light").keys() == {"model"}

    # the answer is the caller's: changing it changes neither the cache nor the optimizer
    got["model"].clear()
    got["optim"]["param_groups"][0]["lr"] = 123.0
    got["optim"]["state"].clear()
    _assert_matches(cache.state_dict("full"), _reference(net, optim))
    assert optim.param_groups[0]["lr"] != 123.0

    # a loaded optimizer state holds new tensors: they are what the next answer holds
    optim.load_state_dict(copy.deepcopy(optim.state_dict()))
    _step(net, optim)
    _assert_matches(cache.state_dict("full"), _reference(net, optim))

    # a parameter over new storage: the model part is built again
    built = cache.builds
    net[0].weight.data = net[0].weight.data.clone()
    _step(net, optim)
    _assert_matches(cache.state_dict("full"), _reference(net, optim))
    assert cache.builds == built + 1


def test_a_parameter_that_gains_optimizer_state_makes_it_ask_torch_again():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    net[0].requires_grad_(False)  # no gradient, so no optimizer state, at first
    optim = torch.optim.AdamW(net.parameters(), lr=0.01)
    cache = StateDictCache(net, optim)
    _step(net, optim)
    first = cache.state_dict("full")
    assert len(first["optim"]["state"]) == 2
    net[0].requires_grad_(True)
    _step(net, optim)
    built = cache.builds
    got = cache.state_dict("full")
    assert len(got["optim"]["state"]) == 4
    assert cache.builds == built + 1
    _assert_matches(got, _reference(net, optim))


class _CountingSGD(torch.optim.SGD):
    """SGD keeping a plain int in each parameter's state."""

    def step(self, closure=None):
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["count"] = self.state[p].get("count", 0) + 1
        return out


def test_state_it_cannot_check_is_never_cached():
    torch.manual_seed(0)
    net = nn.Linear(8, 4)
    optim = _CountingSGD(net.parameters(), lr=0.1)
    cache = StateDictCache(net, optim)
    for i in range(3):
        _step(net, optim)
        built = cache.builds
        got = cache.state_dict("full")
        assert cache.builds == built + (2 if i == 0 else 1)  # the optimizer part every time
        _assert_matches(got, _reference(net, optim))


def _trained() -> tuple[nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    optim = torch.optim.AdamW(net.parameters(), lr=0.01, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.LinearLR(optim, start_factor=1.0, end_factor=0.1,
                                              total_iters=10)
    for _ in range(2):
        _step(net, optim)
        sched.step()
    return net, optim, sched


def _values(net: nn.Module, optim: torch.optim.Optimizer) -> dict:
    """Every value a resume must restore, as plain data."""
    return copy.deepcopy({"model": dict(net.state_dict()), "optim": optim.state_dict()})


def _assert_same_values(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"]
    assert a["optim"]["state"].keys() == b["optim"]["state"].keys()
    for i, entry in a["optim"]["state"].items():
        assert entry.keys() == b["optim"]["state"][i].keys()
        for k, v in entry.items():
            assert torch.equal(v, b["optim"]["state"][i][k]), (i, k)


@pytest.fixture
def torch_calls(monkeypatch):
    """The calls of torch's set_model_state_dict / set_optimizer_state_dict (still made)."""
    from torch.distributed.checkpoint import state_dict as torch_sd

    calls = []
    for name in ("set_model_state_dict", "set_optimizer_state_dict"):
        real = getattr(torch_sd, name)
        monkeypatch.setattr(torch_sd, name,
                            lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    return calls


def _load(cache: StateDictCache, path: str, *, ours: bool) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = cache.state_dict("full")
    dcp.load(state, checkpoint_id=path, no_dist=True)
    if ours:
        cache.load_state_dict(state)
    else:
        set_model_state_dict(cache.model, state["model"])
        set_optimizer_state_dict(cache.model, cache.optim, state["optim"])


def test_loading_into_the_live_tensors_leaves_what_torchs_functions_leave(tmp_path, torch_calls):
    """After a DCP load into the cache's dicts, ``load_state_dict`` applies what is left (the
    param groups' values) without torch's functions, and training goes on exactly as it
    does after torch's functions."""
    net, optim, _ = _trained()
    path = str(tmp_path / "ckpt")
    dcp.save(StateDictCache(net, optim).state_dict("full"), checkpoint_id=path, no_dist=True)
    saved = _values(net, optim)
    twins = []
    for ours in (True, False):
        net, optim, sched = _trained()
        cache = StateDictCache(net, optim)
        cache.state_dict("full")
        for _ in range(3):  # the state, the running stats and the learning rate move on
            _step(net, optim)
            sched.step()
        assert optim.param_groups[0]["lr"] != saved["optim"]["param_groups"][0]["lr"]
        torch_calls.clear()
        _load(cache, path, ours=ours)
        assert torch_calls == ([] if ours else ["set_model_state_dict", "set_optimizer_state_dict"])
        _assert_same_values(_values(net, optim), saved)
        torch.manual_seed(7)
        _step(net, optim)
        twins.append(_values(net, optim))
    _assert_same_values(*twins)


def test_anything_but_the_live_tensors_goes_through_torchs_functions(tmp_path, torch_calls):
    net, optim, _ = _trained()
    path = str(tmp_path / "ckpt")
    dcp.save(StateDictCache(net, optim).state_dict("full"), checkpoint_id=path, no_dist=True)
    saved = _values(net, optim)

    def fresh():
        net, optim, _ = _trained()
        _step(net, optim)
        cache = StateDictCache(net, optim)
        return net, optim, cache, cache.state_dict("full")

    # tensors of its own (as a full or offloaded state dict holds): torch applies both parts
    net, optim, cache, _ = fresh()
    state = {"model": {k: v.clone() for k, v in cache.model_state_dict().items()},
             "optim": copy.deepcopy(cache.optimizer_state_dict())}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    torch_calls.clear()
    cache.load_state_dict(state)
    assert torch_calls == ["set_model_state_dict", "set_optimizer_state_dict"]
    _assert_same_values(_values(net, optim), saved)

    # a load hook of the user's own runs: the model part goes through torch
    net, optim, cache, _ = fresh()
    ran = []
    net[2].register_load_state_dict_post_hook(lambda module, keys: ran.append(module))
    torch_calls.clear()
    _load(cache, path, ours=True)
    assert torch_calls == ["set_model_state_dict"] and ran == [net[2]]
    _assert_same_values(_values(net, optim), saved)

    # so does an optimizer's
    net, optim, cache, _ = fresh()
    optim.register_load_state_dict_pre_hook(lambda opt, sd: ran.append(opt))
    torch_calls.clear()
    _load(cache, path, ours=True)
    assert torch_calls == ["set_optimizer_state_dict"] and ran[-1] is optim
    _assert_same_values(_values(net, optim), saved)

    # param groups with other keys than the optimizer's: torch decides
    net, optim, cache, state = fresh()
    dcp.load(state, checkpoint_id=path, no_dist=True)
    state["optim"]["param_groups"][0]["extra"] = 1
    torch_calls.clear()
    cache.load_state_dict(state)
    assert torch_calls == ["set_optimizer_state_dict"]
    assert optim.param_groups[0]["extra"] == 1
