"""Switch verl to raycheckpoint's checkpoint manager: importing this module does it.

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


PATCHED = install()
