"""StateDictCache: an FSDP2 model's and optimizer's state dicts, built by torch once and
reused while the tensors behind them stay the same, and loaded back without copying each
tensor onto itself.

:func:`optimizer_state_dict` is torch's ``get_optimizer_state_dict`` without the
optimizer step it counts when called before the first one.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def optimizer_state_dict(model: torch.nn.Module, optim: torch.optim.Optimizer,
                         options: Any = None) -> dict[str, Any]:
    """``get_optimizer_state_dict`` that leaves training exactly as it would be without it.

    Before the first ``optim.step()`` an optimizer has no state; torch's
    ``get_optimizer_state_dict`` then creates it by running one step with zero gradients
    and lr=0, which leaves the weights alone but counts a step: Adam's bias correction
    would then run one step ahead, so merely snapshotting (or preparing buffers) before
    the first step would change training.  Here the counted step is undone, giving the
    state the optimizer's own first step creates (zero moments, ``step`` 0).
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    fresh = not optim.state
    state = get_optimizer_state_dict(model, optim, options=options)
    if fresh and optim.state:
        for param_state in optim.state.values():
            step = param_state.get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()
            elif isinstance(step, (int, float)):
                param_state["step"] = type(step)(0)
        state = get_optimizer_state_dict(model, optim, options=options)
    return state


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class StateDictCache:
    """``get_model_state_dict`` and :func:`optimizer_state_dict` of an FSDP2 model, built
    by torch once and then reused while the tensors behind them stay the same.

    torch builds both dicts in Python, item by item (about 35 ms for 200 parameters and
    their AdamW state on this project's test machines), and a worker's
    ``ckpt_state_dict`` runs while training is blocked.  Between saves the parameters
    and the optimizer's state tensors are updated in place, so the dicts hold the same
    tensors.  Each call checks that (every parameter and buffer is the same object over
    the same storage; every optimizer state entry has the same keys, all tensors) and
    then reads the optimizer's state and param-group values (learning rate, ...) afresh,
    in about 2 ms.  Anything replaced (a loaded optimizer state, re-wrapped parameters,
    state created by the first step) makes it ask torch again.  It never caches what it
    cannot check: torch's answer holding a tensor that is not one of the live tensors
    (``StateDictOptions`` such as full or offloaded state dicts: pass those to torch
    directly), or non-tensor optimizer state.  Until a call notices that a parameter
    was replaced, the cached dict keeps the old parameter's storage alive.
    """

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer | None = None) -> None:
        self.model, self.optim = model, optim
        self._model_key: list[tuple[weakref.ref, int]] | None = None
        self._model_sd: dict[str, Any] | None = None
        self._optim_plan: tuple | None = None
        self.builds = 0  # how many times torch built a dict (tests, diagnostics)

    def state_dict(self, kind: str) -> dict[str, Any]:
        """``{"model": ...}``, with ``"optim"`` too for ``kind="full"`` when there is one."""
        state = {"model": self.model_state_dict()}
        if kind == "full" and self.optim is not None:
            state["optim"] = self.optimizer_state_dict()
        return state

    # ---- model ----------------------------------------------------------------------------

    def _live_model(self) -> list[torch.Tensor]:
        return [*self.model.parameters(), *self.model.buffers()]

    def _model_current(self, live: list[torch.Tensor]) -> bool:
        """Whether the cached model dict still holds ``live`` (:meth:`_live_model`)."""
        key = self._model_key
        return (key is not None and len(key) == len(live) and all(
            ref() is t and _local(t).data_ptr() == ptr
            for (ref, ptr), t in zip(key, live, strict=True)))

    def model_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        with torch.no_grad():
            live = self._live_model()
            if self._model_current(live):
                return dict(self._model_sd)
            sd = get_model_state_dict(self.model)
            self.builds += 1
            ptrs = {_local(t).data_ptr() for t in live}
            cacheable = all(isinstance(v, torch.Tensor) and _local(v).data_ptr() in ptrs
                            for v in sd.values())
            self._model_key = ([(weakref.ref(t), _local(t).data_ptr()) for t in live]
                               if cacheable else None)
            self._model_sd = dict(sd) if cacheable else None
            return sd

    # ---- optimizer -------------------------------------------------------------------------

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optim.param_groups for p in group["params"]]

    def _read_optim(self, plan: tuple) -> dict[str, Any] | None:
        """The optimizer's state dict read straight from it, or None if ``plan`` is stale."""
        refs, entries, group_fqns, with_state = plan
        params = self._params()
        if len(params) != len(refs) or any(r() is not p for r, p in zip(refs, params, strict=True)):
            return None
        if [i for i, p in enumerate(params) if self.optim.state.get(p)] != with_state:
            return None  # a parameter gained (or lost) state since torch's answer
        state: dict[str, Any] = {}
        for fqn, index, keys in entries:
            entry = self.optim.state.get(params[index])
            if entry is None or tuple(entry) != keys or not all(
                    isinstance(v, torch.Tensor) for v in entry.values()):
                return None
            state[fqn] = dict(entry)
        if len(self.optim.param_groups) != len(group_fqns):
            return None
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(fqns)}
                  for g, fqns in zip(self.optim.param_groups, group_fqns, strict=True)]
        return {"state": state, "param_groups": groups}

    def _plan(self, sd: dict[str, Any]) -> tuple | None:
        """How to read ``sd`` (torch's answer) from the optimizer itself, if it holds
        exactly the optimizer's own state tensors and param-group values."""
        params = self._params()
        where = {id(v): (i, k) for i, p in enumerate(params)
                 for k, v in self.optim.state.get(p, {}).items() if isinstance(v, torch.Tensor)}
        entries = []
        for fqn, entry in sd.get("state", {}).items():
            index = None
            for k, v in entry.items():  # each value is the optimizer's own, for one parameter
                spot = where.get(id(v))
                if spot is None or spot[1] != k or index not in (None, spot[0]):
                    return None
                index = spot[0]
            if index is None or tuple(self.optim.state[params[index]]) != tuple(entry):
                return None
            entries.append((fqn, index, tuple(entry)))
        plan = ([weakref.ref(p) for p in params], entries,
                [list(g["params"]) for g in sd.get("param_groups", [])],
                sorted(i for _, i, _ in entries))
        again = self._read_optim(plan)
        if again is None or set(sd) != {"state", "param_groups"} or not _same_leaves(again, sd):
            return None
        return plan

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Apply ``state``: a dict :meth:`state_dict` returned, which a load has filled.

        A DCP load (the worker's ``ckpt_load``) copies the saved tensors into the tensors
        of the dict it is given, and this cache's dicts hold the live parameters, buffers
        and optimizer state: those are loaded already.  What is left is the optimizer's
        param-group values (learning rate, betas, ...), which the load replaced in
        ``state``, applied as ``Optimizer.load_state_dict`` applies them.  torch's
        ``set_model_state_dict`` and ``set_optimizer_state_dict`` would also copy every
        tensor onto itself and rebuild the optimizer's state (12-50 ms for 788 tensors on
        this project's test machines, the first load in a process the slowest).

        Where ``state`` holds anything but those very tensors, or a module or the
        optimizer has load hooks FSDP2 did not register (FSDP2's re-shard and re-pad
        parameters, which does nothing to tensors loaded in place), a part goes through
        torch's function instead, with the same result.
        """
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if not self._model_loaded_in_place(state["model"]):
            set_model_state_dict(self.model, state["model"])
        if "optim" not in state:
            return
        if self.optim is None:
            raise ValueError("StateDictCache: no optimizer was given")
        groups = self._loaded_groups(state["optim"])
        if groups is None:
            set_optimizer_state_dict(self.model, self.optim, state["optim"])
            return
        for group, saved in zip(self.optim.param_groups, groups, strict=True):
            group.update(copy.deepcopy({k: v for k, v in saved.items() if k != "params"}))

    def _model_loaded_in_place(self, sd: dict[str, Any]) -> bool:
        cached = self._model_sd
        return (cached is not None and isinstance(sd, dict) and sd.keys() == cached.keys()
                and all(sd[k] is v for k, v in cached.items())
                and self._model_current(self._live_model())
                and _only_fsdp_load_hooks(self.model))

    def _loaded_groups(self, sd: Any) -> list[dict[str, Any]] | None:
        """The loaded param groups, where ``sd`` holds exactly the optimizer's own state
        tensors and the groups' keys and parameters; else None."""
        live = None if self._optim_plan is None else self._read_optim(self._optim_plan)
        if (live is None or not isinstance(sd, dict) or set(sd) != {"state", "param_groups"}
                or self.optim._optimizer_load_state_dict_pre_hooks
                or self.optim._optimizer_load_state_dict_post_hooks):
            return None
        state, groups = sd["state"], sd["param_groups"]
        if not isinstance(state, dict) or state.keys() != live["state"].keys() or any(
                not isinstance(state[fqn], dict) or state[fqn].keys() != entry.keys()
                or any(state[fqn][k] is not v for k, v in entry.items())
                for fqn, entry in live["state"].items()):
            return None
        if not isinstance(groups, list) or len(groups) != len(live["param_groups"]) or any(
                not isinstance(g, dict) or g.keys() != ref.keys()
                or list(g["params"]) != ref["params"]
                for g, ref in zip(groups, live["param_groups"], strict=True)):
            return None
        return groups

    def optimizer_state_dict(self) -> dict[str, Any]:
        if self.optim is None:
            raise ValueError("StateDictCache: no optimizer was given")
        if self._optim_plan is not None:
            sd = self._read_optim(self._optim_plan)
            if sd is not None:
                return sd
        with torch.no_grad():
            sd = optimizer_state_dict(self.model, self.optim)
        self.builds += 1
        self._optim_plan = self._plan(sd)
        return sd


def _same_leaves(a: Any, b: Any) -> bool:
    """Same structure, the very same tensors, equal other values."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_leaves(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same_leaves(x, y) for x, y in zip(a, b, strict=True)))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001 - a value whose == is not a plain bool: not comparable
        return False


def _only_fsdp_load_hooks(model: torch.nn.Module) -> bool:
    """Whether every ``load_state_dict`` hook on ``model``'s modules is one FSDP2
    registered: a pre-hook that re-shards a parameter group, a post-hook that re-pads a
    replaced parameter.  False where FSDP2's internals are not as this torch has them."""
    pre: set[int] = set()
    post: set[int] = set()
    try:
        for module in model.modules():
            get_state = getattr(module, "_get_fsdp_state", None)
            if get_state is None:
                continue
            for group in get_state()._fsdp_param_groups:
                pre |= {h.id for h in group._module_to_pre_load_state_dict_hook_handle.values()}
                post |= {p._post_load_hook_handle.id for p in group.fsdp_params}
        return all(set(m._load_state_dict_pre_hooks) <= pre
                   and set(m._load_state_dict_post_hooks) <= post for m in model.modules())
    except AttributeError:
        return False
