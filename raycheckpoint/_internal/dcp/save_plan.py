"""ReusingSavePlanner: DCP's default save planner, reusing its work between saves.

A saver stages into the same host buffers every time, so the structure, shapes and
shard offsets of what it saves do not change: the local plan (one write item per
tensor, computed in Python over every DTensor), each item's resolved local tensor and
the flattened state dict are computed once.  Non-tensor items are resolved anew each
save (their values change).  The owner drops the planner, or calls
:meth:`ReusingSavePlanner.forget_tensors`, when its buffers change.

The planner plans; what a save made with it leaves for the next saves (the agreed
outcome, the data files' layout) is kept beside it in a
:class:`~raycheckpoint._internal.dcp.shard_plan.ShardPlan`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import DefaultSavePlanner, SavePlan
from torch.distributed.checkpoint.planner import WriteItemType


class ReusingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, its local plan, resolved tensors and flattened state
    computed once (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self._cached_plan: SavePlan | None = None
        self._resolved: dict[Any, torch.Tensor] = {}
        # the last flattened state dict, and where its non-tensor values lie in the nested
        # one (set_up_planner); None until a state without ShardedTensors was flattened
        self._flat: dict[str, Any] | None = None
        self._value_paths: list[tuple[str, tuple]] = []

    @property
    def cached_plan(self) -> SavePlan | None:
        """The local plan this planner computed once (the same object at every save)."""
        return self._cached_plan

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        """DCP's flattening of ``state_dict`` (a dict keyed by dotted paths), done once.

        DCP flattens the nested state dict at every save, walking every leaf in Python
        (3-4 ms of a persist thread's GIL at 800 tensors, on the durable path).  Here the
        tensors are the staged buffers, the same objects at the same paths from save to
        save (the planner's contract), so the last flattened dict is reused and only its
        non-tensor values (learning rates, flags) are read afresh from ``state_dict``.  A
        state whose non-tensor paths no longer resolve is flattened anew.
        """
        if self._flat is not None:
            flat = dict(self._flat)
            try:
                for fqn, path in self._value_paths:
                    value = state_dict
                    for part in path:
                        value = value[part]
                    if isinstance(value, torch.Tensor):
                        raise TypeError(fqn)  # a value turned into a tensor: not this structure
                    flat[fqn] = value
            except (KeyError, IndexError, TypeError):
                self._flat = None
            else:
                self.state_dict, self.is_coordinator = flat, is_coordinator
                return
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        flat = self.state_dict
        if self.flatten_state_dict and not any(isinstance(v, ShardedTensor) for v in flat.values()):
            self._flat = flat
            self._value_paths = [(fqn, self.mappings[fqn]) for fqn, v in flat.items()
                                 if not isinstance(v, torch.Tensor)]

    def create_local_plan(self) -> SavePlan:
        if self._cached_plan is None:
            self._cached_plan = super().create_local_plan()
        self.plan = replace(self._cached_plan, planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item: Any) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        tensor = self._resolved.get(write_item.index)
        if tensor is None:
            tensor = self._resolved[write_item.index] = super().resolve_data(write_item)
        return tensor

    def resolved(self, index: Any) -> torch.Tensor | None:
        """The tensor item ``index`` resolved to, where it was resolved."""
        return self._resolved.get(index)

    def forget_tensors(self) -> None:
        """Drop every resolved tensor and the flattened state: the staged tensors moved."""
        self._resolved.clear()
        self._flat = None
