"""``raycheckpoint``: look at, verify, clean up and export checkpoints; no Ray needed.

    raycheckpoint ls ROOT
    raycheckpoint inspect REF [--all-tensors]
    raycheckpoint verify REF|ROOT
    raycheckpoint gc ROOT [--dry-run] [--keep-last-n N ...] [--grace-s S]
    raycheckpoint export REF OUT --format hf|state_dict [--role actor]
    raycheckpoint diff REF CONFIG [--fingerprint MODULE:FUNC]
    raycheckpoint tag REF NAME  /  raycheckpoint untag ROOT NAME

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
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_ERROR = 0, 1, 2


# ---- output helpers ----------------------------------------------------------------------------

def _console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # a pipe or a log file gets wide tables instead of rich's 80-column default
    width = None if stream.isatty() else 160
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=width)


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _metrics_text(metrics: dict[str, Any]) -> str:
    parts = []
    for k, v in sorted(metrics.items()):
        parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(parts)


@contextmanager
def progress_bar(description: str, enabled: bool) -> Iterator[tuple[Callable[[int], None],
                                                                    Callable[[int], None]]]:
    """(set_total(bytes), advance(bytes)) callbacks driving a rich progress bar on stderr."""
    if not enabled:
        yield (lambda n: None), (lambda n: None)
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=_console(stderr=True),
                  transient=True) as bar:
        task = bar.add_task(description, total=None)
        yield (lambda n: bar.update(task, total=n)), (lambda n: bar.advance(task, n))


def _emit_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")


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
                   help="key of an encrypted checkpoint (verify needs none)")


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
    _add_common(p)

    p = sub.add_parser("inspect", help="roles, world sizes, tensors, trainer state, version")
    _add_ref(p)
    p.add_argument("--all-tensors", action="store_true",
                   help="list optimizer tensors too (default: model tensors only)")
    _add_key(p)
    _add_common(p)

    p = sub.add_parser("verify", help="full verification (presence, sizes, checksums); exit 0/1")
    _add_ref(p, "REF|ROOT")
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
    return parser


# ---- commands -----------------------------------------------------------------------------------

def cmd_ls(args: argparse.Namespace) -> int:
    from rich.table import Table

    from raycheckpoint import admin

    doc = admin.list_root(admin.open_root(args.root, storage_options(args)))
    if args.json:
        _emit_json(doc)
        return EXIT_OK
    console = _console()
    if not doc["checkpoints"]:
        console.print(f"no checkpoints under {doc['root']}")
        return EXIT_OK
    table = Table(title=f"{doc['root']}  (LATEST -> {doc['latest'] or 'none'})", title_justify="left")
    for col in ("step", "name", "kind", "tags", "metrics", "size", "age", "state"):
        table.add_column(col, justify="right" if col in ("step", "size", "age") else "left")
    for r in doc["checkpoints"]:
        state = r["state"] + (" LATEST" if r["latest"] else "")
        style = "yellow" if r["state"] != "committed" else ("bold" if r["latest"] else None)
        table.add_row(str(r["step"]), r["name"], r["kind"] or "-", ",".join(r["tags"]) or "-",
                      _metrics_text(r["metrics"]) or "-", human_bytes(r["bytes"]),
                      human_age(r["age_s"]), state, style=style)
    console.print(table)
    lease = doc["lease"]
    if lease is not None:
        state = "held by" if lease["fresh"] else "stale lease of"
        console.print(f"LEASE: {state} {lease['holder']}")
    for t, target in sorted(doc["dangling_tags"].items()):
        console.print(f"[yellow]tag {t} points to {target}, which is not committed[/yellow]")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    from rich.table import Table

    from raycheckpoint import admin

    ck = admin.open_ref(args.ref, storage_options(args), step=args.step, tag=args.tag,
                        key=args.encryption_key)
    doc = admin.inspect_checkpoint(ck)
    if args.json:
        _emit_json(doc)
        return EXIT_OK
    console = _console()
    console.print(f"[bold]{doc['name']}[/bold]  step {doc['step']}  {doc['kind']}"
                  + (f"  tag {doc['tag']}" if doc["tag"] else "")
                  + f"  {human_bytes(doc['bytes'])} in {doc['files']} files  committed "
                  + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(doc["committed_at"])))
    v = doc["version"]
    console.print(f"format {v.get('format_version')} (readable from {v.get('compatible_since')}), "
                  f"written by raycheckpoint {v.get('library_version')}"
                  + (f"; encrypted {doc['encryption']['algorithm']}, key id "
                     f"{doc['encryption']['key_id']}" if doc.get("encryption") else ""))
    roles = Table(title="roles", title_justify="left")
    for col in ("role", "world size", "files", "size", "stored in", "assets"):
        roles.add_column(col)
    for role, r in doc["roles"].items():
        roles.add_row(role, str(r["world_size"]), str(r["files"]), human_bytes(r["bytes"]),
                      r["stored_in"] or "here", ", ".join(r["assets"]) or "-")
    console.print(roles)
    for role, r in doc["roles"].items():
        tensors = r.get("tensors") or []
        shown = tensors if args.all_tensors else [t for t in tensors if t["name"].startswith("model.")]
        if not shown:
            continue
        table = Table(title=f"{role}: {len(shown)} of {len(tensors)} tensors"
                      + ("" if args.all_tensors else " (model; --all-tensors for the rest)"),
                      title_justify="left")
        for col in ("name", "shape", "dtype", "shards"):
            table.add_column(col)
        for t in shown:
            table.add_row(t["name"], "x".join(map(str, t["shape"])) or "scalar", t["dtype"],
                          str(t["chunks"]))
        console.print(table)
    ts = doc["trainer_state"]
    console.print("trainer state: " + ", ".join(
        f"{k}={ts[k]}" for k in ("global_step", "epoch", "kind", "tag") if k in ts))
    if ts.get("metrics"):
        console.print("metrics: " + _metrics_text(ts["metrics"]))
    if ts.get("dataloader"):
        console.print("data loader: " + json.dumps(ts["dataloader"], sort_keys=True, default=str)[:200])
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from raycheckpoint import admin

    with progress_bar("verifying", not args.json and sys.stderr.isatty()) as (total, advance):
        doc = admin.verify(args.ref, storage_options(args), step=args.step, tag=args.tag,
                           on_total=total, progress=advance)
    if args.json:
        _emit_json(doc)
    else:
        console = _console()
        for r in doc["checkpoints"]:
            if r["ok"]:
                console.print(f"[green]OK[/green]      {r['name']}  {r['kind']}  {r['files']} files "
                              f"{human_bytes(r['bytes'])}")
            else:
                console.print(f"[red]FAILED[/red]  {r['name']}  {r['error']}")
        for p in doc["problems"]:
            console.print(f"[yellow]note[/yellow]    {p}")
        bad = sum(not r["ok"] for r in doc["checkpoints"])
        console.print(f"{len(doc['checkpoints']) - bad} verified, {bad} failed under {doc['root']}")
    return EXIT_OK if doc["ok"] else EXIT_FAILED


def cmd_gc(args: argparse.Namespace) -> int:
    from raycheckpoint import admin

    overrides = {"keep_last_n": args.keep_last_n, "keep_last_n_light": args.keep_last_n_light,
                 "keep_best_n": args.keep_best_n, "best_metric": args.best_metric,
                 "best_mode": args.best_mode}
    doc = admin.gc(args.root, storage_options(args), dry_run=args.dry_run,
                   leftover_grace_s=args.grace_s, overrides=overrides, force=args.force)
    if args.json:
        _emit_json(doc)
        return EXIT_OK
    console = _console()
    verb = "would delete" if args.dry_run else "deleted"
    rules = {k: v for k, v in doc["rules"].items() if v is not None}
    console.print(f"retention rules ({doc['rules_source']}): "
                  + (", ".join(f"{k}={v}" for k, v in sorted(rules.items())) or "none (nothing is "
                     "governed; pass --keep-last-n / --keep-last-n-light)"))
    console.print(f"{verb} by retention: {', '.join(doc['deleted']) or 'nothing'}")
    console.print(f"{verb} as leftovers of failed saves: {', '.join(doc['collected']) or 'nothing'}")
    if doc["kept_recent"]:
        console.print(f"kept (written within {doc['leftover_grace_s']:.0f}s, a save may be in "
                      f"flight): {', '.join(doc['kept_recent'])}")
    if doc["fixed_latest"]:
        console.print(("would repair" if args.dry_run else "repaired") + " LATEST")
    if doc["rebuilt_catalog"]:
        console.print(("would rebuild" if args.dry_run else "rebuilt") + " catalog.json")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from raycheckpoint import admin
    from raycheckpoint.export import export

    ck = admin.open_ref(args.ref, storage_options(args), step=args.step, tag=args.tag,
                        key=args.encryption_key)
    with progress_bar(f"exporting {ck.name}/{args.role}",
                      not args.json and sys.stderr.isatty()) as (total, advance):
        doc = export(ck, args.out, fmt=args.fmt, role=args.role, force=args.force,
                     progress=advance, on_total=total)
    if args.json:
        _emit_json(doc)
    else:
        _console().print(f"exported {doc['checkpoint']} (step {doc['step']}) role {doc['role']} as "
                         f"{doc['format']}: {doc['tensors']} tensors, {human_bytes(doc['bytes'])} "
                         f"-> {doc['out']} ({', '.join(doc['files'])})")
    return EXIT_OK


def _load_mapping(path: str) -> dict[str, Any]:
    with open(path) as f:
        text = f.read()
    try:
        doc = json.loads(text)
    except ValueError:
        import yaml

        doc = yaml.safe_load(text)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a JSON or YAML mapping")
    return doc


def cmd_diff(args: argparse.Namespace) -> int:
    from raycheckpoint import admin

    ck = admin.open_ref(args.ref, storage_options(args), step=args.step, tag=args.tag)
    config = _load_mapping(args.config)
    if args.fingerprint:
        module, sep, func = args.fingerprint.partition(":")
        if not sep:
            raise ValueError(f"--fingerprint expects MODULE:FUNC, got {args.fingerprint!r}")
        job = getattr(importlib.import_module(module), func)(config)
    elif "config_fingerprint" in config:
        job = config
    else:
        job = {"config_fingerprint": config}
    doc = admin.diff(ck, job, allow_reshard=args.allow_reshard)
    if args.json:
        _emit_json(doc)
    else:
        console = _console()
        if doc["resumable"]:
            console.print(f"[green]{doc['checkpoint']} can be resumed strictly by this job[/green]")
        else:
            console.print(f"[red]{len(doc['blocking'])} difference(s) block a strict resume of "
                          f"{doc['checkpoint']}:[/red]")
            for d in doc["blocking"]:
                note = f"  ({d['note']})" if d.get("note") else ""
                console.print(f"  {d['key']}: saved {d['saved']!r}, now {d['now']!r}{note}")
    return EXIT_OK if doc["resumable"] else EXIT_FAILED


def cmd_tag(args: argparse.Namespace) -> int:
    from raycheckpoint import admin

    doc = admin.tag(args.ref, args.name, storage_options(args), step=args.step,
                    source_tag=args.tag, force=args.force)
    if args.json:
        _emit_json(doc)
    else:
        previous = doc["previous"]
        moved = f" (was {previous})" if previous and previous != doc["checkpoint"] else ""
        _console().print(f"tag {doc['tag']} -> {doc['checkpoint']}{moved}")
    return EXIT_OK


def cmd_untag(args: argparse.Namespace) -> int:
    from raycheckpoint import admin

    doc = admin.untag(args.root, args.name, storage_options(args))
    if args.json:
        _emit_json(doc)
    else:
        _console().print(f"removed tag {doc['tag']} (was -> {doc['checkpoint']})")
    return EXIT_OK


COMMANDS = {"ls": cmd_ls, "inspect": cmd_inspect, "verify": cmd_verify, "gc": cmd_gc,
            "export": cmd_export, "diff": cmd_diff, "tag": cmd_tag, "untag": cmd_untag}


def main(argv: list[str] | None = None) -> int:
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


if __name__ == "__main__":
    sys.exit(main())
