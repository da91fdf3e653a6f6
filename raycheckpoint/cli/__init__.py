"""``raycheckpoint``: look at, verify, clean up and export checkpoints; no Ray needed
(except to list a running job's memory tier, ``ls --memory``, and for ``import-verl``).

    raycheckpoint ls ROOT [--local DIR [--memory RAY_ADDRESS]]
    raycheckpoint inspect REF [--all-tensors]
    raycheckpoint verify REF|ROOT [--encryption-key KEY]
    raycheckpoint reseal REF --encryption-key KEY
    raycheckpoint gc ROOT [--dry-run] [--keep-last-n N ...] [--grace-s S]
    raycheckpoint export REF OUT --format hf|state_dict [--role actor]
    raycheckpoint diff REF CONFIG [--fingerprint MODULE:FUNC]
    raycheckpoint tag REF NAME  /  raycheckpoint untag ROOT NAME
    raycheckpoint import-verl DIR [--step N] [--role actor ...] [--save-dir ROOT]

REF is a checkpoint directory (``ROOT/step_00000010``), a root (meaning its LATEST), or
a root with ``--step N`` / ``--tag NAME``.  Any fsspec URI works (``s3://bucket/run``);
storage options come from ``--storage-option KEY=VALUE`` (repeatable; values parsed as
JSON when they can be) and the ``RAYCHECKPOINT_STORAGE_OPTIONS`` environment variable (a
JSON object).  ``--json`` prints one JSON document instead of tables.

Exit codes: 0 success; 1 verification failed or a strict resume would be refused;
2 a usage or access error (one line on stderr, no traceback unless ``--debug``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_ERROR = 0, 1, 2


# ---- arguments ----------------------------------------------------------------------------------

def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {}
    env = os.environ.get("RAYCHECKPOINT_STORAGE_OPTIONS")
    if env:
        try:
            options.update(json.loads(env))
        except ValueError as e:
            raise ValueError(f"RAYCHECKPOINT_STORAGE_OPTIONS is not a JSON object: {e}") from None
    for item in args.storage_option or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--storage-option expects KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-option", "-o", action="append", metavar="KEY=VALUE",
                   help="fsspec storage option (repeatable), e.g. endpoint_url=http://127.0.0.1:9000")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def _add_key(p: argparse.ArgumentParser) -> None:
    p.add_argument("--encryption-key", metavar="env:NAME|file:PATH",
                   help="key of an encrypted checkpoint (verify: checks its authenticity "
                        "too; without the key, checksums only)")


def _add_ref(p: argparse.ArgumentParser, what: str = "REF") -> None:
    p.add_argument("ref", metavar=what,
                   help="checkpoint directory, or a root (its LATEST, or --step/--tag)")
    p.add_argument("--step", type=int, help="with a root: the checkpoint at this step")
    p.add_argument("--tag", help="with a root: the checkpoint this tag points to")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raycheckpoint", description="Inspect, verify, clean up and export raycheckpoint "
        "checkpoints (local paths or any fsspec URI such as s3://bucket/run).")
    from raycheckpoint import __version__

    parser.add_argument("--version", action="version", version=f"raycheckpoint {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("ls", help="committed checkpoints and uncommitted leftovers of a root")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--local", metavar="DIR", default=None,
                   help="a tiered job's local tier (checkpoint.local_dir): list both tiers, "
                        "with the tiers that hold each checkpoint")
    p.add_argument("--memory", metavar="RAY_ADDRESS", default=None,
                   help="with --local: the memory tier too (checkpoint.memory_replicas), read "
                        "from the replica holders of the Ray cluster at this address ('auto': "
                        "the cluster this machine belongs to)")
    _add_common(p)

    p = sub.add_parser("inspect", help="roles, world sizes, tensors, trainer state, version")
    _add_ref(p)
    p.add_argument("--all-tensors", action="store_true",
                   help="list optimizer tensors too (default: model tensors only)")
    _add_key(p)
    _add_common(p)

    p = sub.add_parser("verify", help="full verification (presence, sizes, checksums); exit 0/1")
    _add_ref(p, "REF|ROOT")
    _add_key(p)
    _add_common(p)

    p = sub.add_parser("gc", help="apply the retention rules and collect leftovers")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    p.add_argument("--grace-s", type=float, default=3600.0,
                   help="keep uncommitted directories written to within this many seconds "
                        "(a running job may still be saving them; default 3600, 0 when no job runs)")
    p.add_argument("--keep-last-n", type=int, help="override the job's keep_last_n")
    p.add_argument("--keep-last-n-light", type=int, help="override the job's keep_last_n_light")
    p.add_argument("--keep-best-n", type=int, help="override the job's keep_best_n")
    p.add_argument("--best-metric", help="override the job's best_metric")
    p.add_argument("--best-mode", choices=("max", "min"), help="override the job's best_mode")
    p.add_argument("--force", action="store_true",
                   help="collect even while a job holds the root's lease")
    _add_common(p)

    p = sub.add_parser("export", help="write a role's weights as a Hugging Face directory or a "
                       "state-dict file")
    _add_ref(p)
    p.add_argument("out", metavar="OUT", help="local output directory (hf) or file (state_dict: "
                   ".safetensors, else torch.save)")
    p.add_argument("--format", dest="fmt", choices=("hf", "state_dict"), default="hf")
    p.add_argument("--role", default="actor")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    _add_key(p)
    _add_common(p)

    p = sub.add_parser("diff", help="what would block a strict resume of REF by the job in CONFIG")
    _add_ref(p)
    p.add_argument("config", metavar="CONFIG",
                   help="JSON or YAML file: the job's options, or a document with "
                        "'config_fingerprint' (e.g. another checkpoint's trainer_state.json)")
    p.add_argument("--fingerprint", metavar="MODULE:FUNC",
                   help="function turning CONFIG's mapping into {'config_fingerprint', "
                        "'world_sizes', 'allow_reshard'} (drivers.main_ppo:job_description for "
                        "this project's RL driver)")
    p.add_argument("--allow-reshard", action=argparse.BooleanOptionalAction, default=None)
    _add_common(p)

    p = sub.add_parser("tag", help="point a tag at a checkpoint (tagged checkpoints are never "
                       "collected)")
    _add_ref(p)
    p.add_argument("name", metavar="NAME")
    p.add_argument("--force", action="store_true", help="move the tag if it points elsewhere")
    _add_common(p)

    p = sub.add_parser("untag", help="remove a tag")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("name", metavar="NAME")
    _add_common(p)

    p = sub.add_parser("reseal", help="vouch for an encrypted checkpoint whose marker has no "
                       "authentication code (written by an older release): check it with the "
                       "key, then seal its marker")
    _add_ref(p)
    p.add_argument("--encryption-key", metavar="env:NAME|file:PATH", required=True,
                   help="the key the checkpoint was written with")
    _add_common(p)

    p = sub.add_parser("import-verl", help="carry a step verl's own manager wrote into the roots "
                       "raycheckpoint's verl switch reads (once, to switch mid-training)")
    p.add_argument("dir", metavar="DIR", help="verl's trainer.default_local_dir")
    p.add_argument("--step", type=int, help="the step (default: the one verl's tracker names)")
    p.add_argument("--role", action="append", help="a role to import (repeatable; default: all)")
    p.add_argument("--save-dir", help="the roots' parent, as the switch's save_dir option "
                   "(default: DIR/raycheckpoint; RAYCHECKPOINT_VERL_OPTIONS is read too)")
    _add_common(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    from raycheckpoint.cli.commands import COMMANDS

    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line for the operator; --debug for the traceback
        if args.debug:
            raise
        from raycheckpoint.errors import RayCheckpointError

        message = str(e).strip() or type(e).__name__
        if not isinstance(e, RayCheckpointError) and type(e).__module__ != "builtins":
            message = f"{type(e).__name__}: {message}"
        print(f"raycheckpoint {args.command}: error: {message.splitlines()[0]}", file=sys.stderr)
        return EXIT_ERROR
