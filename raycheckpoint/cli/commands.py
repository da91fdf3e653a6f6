"""The ``raycheckpoint`` subcommands: each turns its arguments into an
:mod:`raycheckpoint.admin` (or :mod:`raycheckpoint.export`) call and prints the result
as tables or JSON."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from typing import Any

from raycheckpoint.cli import EXIT_FAILED, EXIT_OK, storage_options
from raycheckpoint.cli.output import (
    emit_json,
    human_age,
    human_bytes,
    make_console,
    metrics_text,
    progress_bar,
)


def cmd_ls(args: argparse.Namespace) -> int:
    from rich.table import Table

    from raycheckpoint import admin

    root = admin.open_root(args.root, storage_options(args))
    if args.memory is not None and args.local is None:
        raise ValueError("--memory lists a tiered job's memory tier: give its --local DIR too")
    doc = (admin.list_root(root) if args.local is None
           else admin.list_tiers(root, admin.open_root(args.local),
                                 memory=_memory_tier(root, args.memory)))
    if args.json:
        emit_json(doc)
        return EXIT_OK
    out = make_console()
    if not doc["checkpoints"]:
        out.print(f"no checkpoints under {doc['root']}")
        return EXIT_OK
    title = f"{doc['root']}  (LATEST -> {doc['latest'] or 'none'})"
    for tier in ("local", "memory"):
        if tier in doc:
            title += (f"\n{tier} tier {doc[tier]['root']}  (LATEST -> "
                      f"{doc[tier]['latest'] or 'none'})")
    table = Table(title=title, title_justify="left")
    columns = ["step", "name", "kind", "tags", "metrics", "size", "age", "state", "verified"]
    for col in columns + (["tiers"] if "local" in doc else []):
        table.add_column(col, justify="right" if col in ("step", "size", "age") else "left")
    now = time.time()
    for r in doc["checkpoints"]:
        state = r["state"] + (" LATEST" if r["latest"] else "")
        style = "yellow" if r["state"] != "committed" else ("bold" if r["latest"] else None)
        tiers = [", ".join(t if s == "committed" else f"{t}: {s}" for t, s in r["tiers"].items())
                 ] if "tiers" in r else []
        table.add_row(str(r["step"]), r["name"], r["kind"] or "-", ",".join(r["tags"]) or "-",
                      metrics_text(r["metrics"]) or "-", human_bytes(r["bytes"]),
                      human_age(r["age_s"]), state, verified_text(r.get("verified"), now), *tiers,
                      style="red" if (r.get("verified") or {}).get("ok") is False else style)
    out.print(table)
    lease = doc["lease"]
    if lease is not None:
        state = "held by" if lease["fresh"] else "stale lease of"
        out.print(f"LEASE: {state} {lease['holder']}")
    for t, target in sorted(doc["dangling_tags"].items()):
        out.print(f"[yellow]tag {t} points to {target}, which is not committed[/yellow]")
    for r in doc["checkpoints"]:
        if r["state"] == "quarantined":
            out.print(f"[yellow]{r['name']} is quarantined: {r['reason']}; `raycheckpoint gc` "
                      "removes it once a newer checkpoint holds its step[/yellow]")
    return EXIT_OK


def _memory_tier(root: Any, address: str | None) -> Any:
    """The memory tier of the job writing ``root``, through the Ray cluster at ``address``."""
    if address is None:
        return None
    import ray

    from raycheckpoint.protocol.memory import tier_id, tier_uri
    from raycheckpoint.storage import Storage

    ray.init(address=address, log_to_driver=False, configure_logging=False)
    return Storage(tier_uri(tier_id(root.url())))


def verified_text(record: dict[str, Any] | None, now: float) -> str:
    """``verified 3m ago`` / ``FAILED 3m ago: <error>`` / ``-`` for a verification record."""
    if not record:
        return "-"
    age = human_age(max(0.0, now - record.get("verified_at", now)))
    if record.get("ok"):
        return f"verified {age} ago"
    return f"FAILED {age} ago: {record.get('error', '?')}"


def cmd_inspect(args: argparse.Namespace) -> int:
    from rich.table import Table

    from raycheckpoint import admin

    ck = admin.open_ref(args.ref, storage_options(args), step=args.step, tag=args.tag,
                        key=args.encryption_key)
    doc = admin.inspect_checkpoint(ck)
    if args.json:
        emit_json(doc)
        return EXIT_OK
    out = make_console()
    out.print(f"[bold]{doc['name']}[/bold]  step {doc['step']}  {doc['kind']}"
                  + (f"  tag {doc['tag']}" if doc["tag"] else "")
                  + f"  {human_bytes(doc['bytes'])} in {doc['files']} files  committed "
                  + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(doc["committed_at"])))
    v = doc["version"]
    out.print(f"format {v.get('format_version')} (readable from {v.get('compatible_since')}), "
                  f"written by raycheckpoint {v.get('library_version')}"
                  + (f"; encrypted {doc['encryption']['algorithm']}, key id "
                     f"{doc['encryption']['key_id']}" if doc.get("encryption") else ""))
    roles = Table(title="roles", title_justify="left")
    for col in ("role", "world size", "files", "size", "stored in", "assets"):
        roles.add_column(col)
    for role, r in doc["roles"].items():
        roles.add_row(role, str(r["world_size"]), str(r["files"]), human_bytes(r["bytes"]),
                      r["stored_in"] or "here", ", ".join(r["assets"]) or "-")
    out.print(roles)
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
        out.print(table)
    ts = doc["trainer_state"]
    out.print("trainer state: " + ", ".join(
        f"{k}={ts[k]}" for k in ("global_step", "epoch", "kind", "tag") if k in ts))
    if ts.get("metrics"):
        out.print("metrics: " + metrics_text(ts["metrics"]))
    if ts.get("dataloader"):
        out.print("data loader: " + json.dumps(ts["dataloader"], sort_keys=True, default=str)[:200])
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from raycheckpoint import admin

    with progress_bar("verifying", not args.json and sys.stderr.isatty()) as (total, advance):
        doc = admin.verify(args.ref, storage_options(args), step=args.step, tag=args.tag,
                           on_total=total, progress=advance, key=args.encryption_key)
    if args.json:
        emit_json(doc)
    else:
        out = make_console()
        for r in doc["checkpoints"]:
            if r["ok"]:
                out.print(f"[green]OK[/green]      {r['name']}  {r['kind']}  {r['files']} files "
                              f"{human_bytes(r['bytes'])}")
            else:
                out.print(f"[red]FAILED[/red]  {r['name']}  {r['error']}")
        for p in doc["problems"]:
            out.print(f"[yellow]note[/yellow]    {p}")
        bad = sum(not r["ok"] for r in doc["checkpoints"])
        out.print(f"{len(doc['checkpoints']) - bad} verified, {bad} failed under {doc['root']}")
    return EXIT_OK if doc["ok"] else EXIT_FAILED


def cmd_gc(args: argparse.Namespace) -> int:
    from raycheckpoint import admin

    overrides = {"keep_last_n": args.keep_last_n, "keep_last_n_light": args.keep_last_n_light,
                 "keep_best_n": args.keep_best_n, "best_metric": args.best_metric,
                 "best_mode": args.best_mode}
    doc = admin.gc(args.root, storage_options(args), dry_run=args.dry_run,
                   leftover_grace_s=args.grace_s, overrides=overrides, force=args.force)
    if args.json:
        emit_json(doc)
        return EXIT_OK
    out = make_console()
    verb = "would delete" if args.dry_run else "deleted"
    rules = {k: v for k, v in doc["rules"].items() if v is not None}
    out.print(f"retention rules ({doc['rules_source']}): "
                  + (", ".join(f"{k}={v}" for k, v in sorted(rules.items())) or "none (every full "
                     "checkpoint is kept; pass --keep-last-n / --keep-best-n)"))
    out.print(f"{verb} by retention: {', '.join(doc['deleted']) or 'nothing'}")
    for name, why in sorted(doc["kept"].items()):
        if name not in doc["deleted"]:
            out.print(f"kept {name}: {'; '.join(why)}")
    out.print(f"{verb} as leftovers of failed saves: {', '.join(doc['collected']) or 'nothing'}")
    if doc["kept_recent"]:
        out.print(f"kept (written within {doc['leftover_grace_s']:.0f}s, a save may be in "
                      f"flight): {', '.join(doc['kept_recent'])}")
    for name in doc.get("removed_quarantined", []):
        out.print(f"{verb} {name}: quarantined ({doc['quarantined'][name]}), superseded by a "
                  "newer checkpoint")
    for name, why in sorted(doc.get("quarantined", {}).items()):
        if name not in doc.get("removed_quarantined", []):
            out.print(f"kept {name}: quarantined ({why}); no newer checkpoint holds its step yet")
    if doc["fixed_latest"]:
        out.print(("would repair" if args.dry_run else "repaired") + " LATEST")
    if doc["rebuilt_catalog"]:
        out.print(("would rebuild" if args.dry_run else "rebuilt") + " catalog.json")
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
        emit_json(doc)
    else:
        make_console().print(f"exported {doc['checkpoint']} (step {doc['step']}) role {doc['role']} as "
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
        emit_json(doc)
    else:
        out = make_console()
        if doc["resumable"]:
            out.print(f"[green]{doc['checkpoint']} can be resumed strictly by this job[/green]")
        else:
            out.print(f"[red]{len(doc['blocking'])} difference(s) block a strict resume of "
                          f"{doc['checkpoint']}:[/red]")
            for d in doc["blocking"]:
                note = f"  ({d['note']})" if d.get("note") else ""
                out.print(f"  {d['key']}: saved {d['saved']!r}, now {d['now']!r}{note}")
    return EXIT_OK if doc["resumable"] else EXIT_FAILED


def cmd_tag(args: argparse.Namespace) -> int:
    from raycheckpoint import admin

    doc = admin.tag(args.ref, args.name, storage_options(args), step=args.step,
                    source_tag=args.tag, force=args.force)
    if args.json:
        emit_json(doc)
    else:
        previous = doc["previous"]
        moved = f" (was {previous})" if previous and previous != doc["checkpoint"] else ""
        make_console().print(f"tag {doc['tag']} -> {doc['checkpoint']}{moved}")
    return EXIT_OK


def cmd_untag(args: argparse.Namespace) -> int:
    from raycheckpoint import admin

    doc = admin.untag(args.root, args.name, storage_options(args))
    if args.json:
        emit_json(doc)
    else:
        make_console().print(f"removed tag {doc['tag']} (was -> {doc['checkpoint']})")
    return EXIT_OK


def cmd_reseal(args: argparse.Namespace) -> int:
    from raycheckpoint import admin
    from raycheckpoint.protocol.reseal import reseal

    storage, names = admin.locate_ref(args.ref, storage_options(args), step=args.step,
                                      tag=args.tag, key=args.encryption_key)
    doc = reseal(storage, names[0])
    if args.json:
        emit_json(doc)
    elif doc["sealed"]:
        make_console().print(f"sealed {doc['name']}: {doc['files']} files verified, "
                             f"{doc['data_files']} data files authenticated with the key")
    else:
        make_console().print(f"{doc['name']} is already sealed with this key")
    return EXIT_OK


def cmd_import_verl(args: argparse.Namespace) -> int:
    from raycheckpoint.integrations.verl.importer import import_step

    options: dict[str, Any] = {}
    if args.save_dir:
        options["save_dir"] = args.save_dir
    if args.storage_option:
        options["storage_options"] = storage_options(args)
    docs = import_step(args.dir, args.step, args.role, options)
    if args.json:
        emit_json(docs)
    else:
        out = make_console()
        for d in docs:
            out.print(f"imported {d['role']} of global_step_{d['step']} (saved by "
                      f"{d['from_world_size']} rank(s); {d['tensors']} tensors, "
                      f"{d['parameters']} parameters) -> {d['root']}")
    return EXIT_OK


COMMANDS = {"ls": cmd_ls, "inspect": cmd_inspect, "verify": cmd_verify, "gc": cmd_gc,
            "export": cmd_export, "diff": cmd_diff, "tag": cmd_tag, "untag": cmd_untag,
            "reseal": cmd_reseal, "import-verl": cmd_import_verl}
