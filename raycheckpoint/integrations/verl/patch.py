"""Switch verl to raycheckpoint's checkpoint manager (and its trainers to raycheckpoint's
resume, their data loader's state into the committed checkpoint, :mod:`.trainer`):
importing this module does it.

verl 0.9 builds its FSDP checkpoint manager inside each worker's engine, from a name
bound at import (``verl/workers/engine/fsdp/transformer_impl.py``), so the switch must
happen in every process that runs verl's workers.  verl imports the modules named in
``VERL_USE_EXTERNAL_MODULES`` in every process on ``import verl``, and raises if one
fails, so one environment variable, carried to the workers by Ray's runtime
environment, does it::

    VERL_USE_EXTERNAL_MODULES=raycheckpoint.integrations.verl.patch python -m verl.trainer.main_ppo ...

On a cluster the job joins, the same variable goes into the job's runtime environment::

    +ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES=\
        raycheckpoint.integrations.verl.patch
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from raycheckpoint.integrations.verl.manager import FSDPCheckpointManager

# where verl binds the name its engines and tests use (a module absent from this verl
# version is passed over)
BINDINGS = (
    "verl.utils.checkpoint.fsdp_checkpoint_manager",
    "verl.workers.engine.fsdp.transformer_impl",
    "verl.workers.engine.veomni.transformer_impl",
)


def install() -> list[str]:
    """Rebind ``FSDPCheckpointManager`` wherever verl binds it; returns the modules
    patched.  Raises when verl has none of them (a verl this does not know)."""
    patched = []
    for name in BINDINGS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "FSDPCheckpointManager"):
            module.FSDPCheckpointManager = FSDPCheckpointManager
            patched.append(name)
    if not patched:
        raise ImportError("raycheckpoint.integrations.verl.patch: this verl binds "
                          f"FSDPCheckpointManager in none of {list(BINDINGS)}")
    return patched


def _trainer(cls_name: str, function: str) -> Callable[[ModuleType], None]:
    def patch(module: ModuleType) -> None:
        from raycheckpoint.integrations.verl import trainer

        cls = getattr(module, cls_name)
        cls._load_checkpoint = getattr(trainer, function)
        save = cls._save_checkpoint
        if getattr(save, "_raycheckpoint", False):
            return

        def _save_checkpoint(self: Any) -> None:  # the loader's state, verl's, the last commits
            trainer.before_save(self)
            save(self)
            trainer.after_save(self)

        _save_checkpoint._raycheckpoint = True
        cls._save_checkpoint = _save_checkpoint

    return patch


# verl's trainers, patched when (and if) a process imports them: their resume and the
# save's data-loader hand-off (raycheckpoint.integrations.verl.trainer); importing them
# here would load verl's whole trainer stack into every worker
TRAINERS: dict[str, Callable[[ModuleType], None]] = {
    "verl.trainer.ppo.v1.trainer_base": _trainer("PPOTrainer", "load_checkpoint"),
    "verl.trainer.ppo.ray_trainer": _trainer("RayPPOTrainer", "load_checkpoint_legacy"),
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs ``TRAINERS[name](module)`` right after module ``name`` is executed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        patch = TRAINERS.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            patch(module)

        loader.exec_module = exec_module
        return spec


def install_trainers() -> None:
    """Patch the trainers already imported; patch the others when they are."""
    for name, patch in TRAINERS.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


PATCHED = install()
install_trainers()
