"""StateDictCache: torch's state dicts, rebuilt only when the tensors behind them change.

Each answer is compared with what torch's ``get_model_state_dict`` and
``optimizer_state_dict`` return at that moment: the same keys, the optimizer's own
tensors and param-group values, model tensors over the parameters' storage.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from raycheckpoint.worker import StateDictCache, _same_leaves, optimizer_state_dict


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
