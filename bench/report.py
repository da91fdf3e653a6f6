"""Targets, tables and plots of :mod:`bench.save_latency` results."""

from __future__ import annotations

from typing import Any

# the targets: (comparison, goal) per ratio
_GOALS = {"stall_over_host_copy": ("<=", 1.3), "stall_over_dcp_async": ("<=", 1.0),
          "durable_over_raw_write": ("<=", 1.2), "durable_over_dcp_sync": ("<=", 1.0),
          "reshard_load_throughput_vs_raw_read": (">=", 0.7),
          "step_slowdown_during_persist": ("<=", 0.10),
          "verl_ratio_fraction_of_best": (">=", 0.75),
          "overlap_stall_over_host_copy": ("<=", 0.25),
          # a save riding on a training step (CheckpointManager.step_save), as the RL job's
          "ride_stall_over_host_copy": ("<=", 1.3),
          "ride_overlap_stall_over_host_copy": ("<=", 0.3)}


def stall_limit(limits: dict[str, Any]) -> float:
    """The host copy a stall is compared with: measured in every round right before
    raycheckpoint's save, where a run has it (``host_copy_beside_s``), so that both face
    the same machine; otherwise the copy measured once before the rounds."""
    return limits.get("host_copy_beside_s") or limits["host_copy_s"]


def targets(point: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets as ratios of this point's medians (None where not measured)."""
    m, lim = point["methods"], point["limits"]
    ours = m.get("raycheckpoint")
    if ours is None:
        return {}
    copy_s = stall_limit(lim)

    def ratio(a, b):
        return None if a is None or b in (None, 0) else a / b

    out: dict[str, Any] = {
        "stall_over_host_copy": ratio(ours["stall_s"], copy_s),
        "stall_over_dcp_async": ratio(ours["stall_s"], (m.get("dcp_async") or {}).get("stall_s")),
        "durable_over_raw_write": ratio(ours["durable_s"], lim["raw_write_fsync_s"]),
        "durable_over_dcp_sync": ratio(ours["durable_s"], (m.get("dcp_sync") or {}).get("durable_s")),
        "reshard_load_throughput_vs_raw_read": ratio(lim["raw_read_s"], ours.get("reshard_load_s")),
        "step_slowdown_during_persist": point.get("step_overhead", {}).get("slowdown"),
        # stretch: the host copy overlapped with the next forward/backward (overlap_copy)
        "overlap_stall_over_host_copy": ratio(point.get("step_overhead", {}).get("overlap_stall_s"),
                                              copy_s),
        "ride_stall_over_host_copy": ratio(point.get("step_overhead", {}).get("ride_stall_s"),
                                           copy_s),
        "ride_overlap_stall_over_host_copy": ratio(
            point.get("step_overhead", {}).get("ride_overlap_stall_s"), copy_s),
    }
    verl = m.get("verl") or m.get("verl_sync")  # verl's own manager, else the imitation
    if verl is not None:
        achieved = ratio(verl["stall_s"], ours["stall_s"])
        best = ratio(verl["stall_s"], copy_s)
        out["verl_stall_ratio"] = achieved
        out["verl_best_ratio"] = best
        out["verl_ratio_fraction_of_best"] = ratio(achieved, best)
        out["verl_method"] = "verl" if "verl" in m else "verl_sync"
        if "returned_s" in verl:  # ours durable against verl's save as is, and with the fsync
            out["durable_over_verl"] = ratio(ours["durable_s"], verl["returned_s"])
            out["durable_over_verl_fsync"] = ratio(ours["durable_s"], verl["durable_s"])
    out["met"] = {k: (None if out.get(k) is None else
                      (out[k] <= v if op == "<=" else out[k] >= v)) for k, (op, v) in _GOALS.items()}
    return out


def rows(point: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The table rows of a point's methods.  verl's own manager gives two: ``verl``, its
    save as it is (durable when the call returns, nothing fsynced), and ``verl + fsync``,
    the same save followed by the fsync of every file it wrote (synchronous like verl's
    save, so training is blocked until it is done)."""
    out = []
    for name, row in point["methods"].items():
        if row.get("returned_s") is None:
            out.append((name, row))
            continue
        out.append((name, {**row, "durable_s": row["returned_s"],
                           "durable_gb_s": row["bytes"] / row["returned_s"] / 1e9}))
        out.append((f"{name} + fsync", {**row, "stall_s": row["durable_s"]}))
    return out


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def _pct(v: float | None, spec: str = "+.1%") -> str:
    return "-" if v is None else format(v, spec)


def table(point: dict[str, Any]) -> str:
    c, lim = point["config"], point["limits"]
    copy_s = stall_limit(lim)
    lines = [f"{c['ranks']} ranks x {c['bytes_per_rank'] / 1e6:.0f} MB per rank "
             f"({c['bytes'] / 1e6:.0f} MB), {c['storage']}, median of {c['repeat']}",
             f"{'method':<18}{'stall s':>9}{'durable s':>10}{'load s':>9}{'reshard s':>10}"
             f"{'GB/s':>7}{'stall/copy':>11}"]
    if c.get("verl_version"):
        lines.insert(1, f"verl {c['verl_version']}: its own FSDPCheckpointManager")
    for name, row in rows(point):
        lines.append(f"{name:<18}{_fmt(row['stall_s']):>9}{_fmt(row['durable_s']):>10}"
                     f"{_fmt(row['load_s']):>9}{_fmt(row['reshard_load_s']):>10}"
                     f"{_fmt(row['durable_gb_s'], '.2f'):>7}"
                     f"{_fmt(row['stall_s'] / copy_s, '.2f'):>11}")
    lines.append(f"{'limit: host copy':<18}{_fmt(copy_s):>9}"
                 + (f"   (before the rounds {_fmt(lim['host_copy_s'])};"
                    if lim.get("host_copy_beside_s") else "   (")
                 + f" fresh memory {_fmt(lim['host_copy_fresh_s'])})")
    lines.append(f"{'limit: write+fsync':<18}{'':>9}{_fmt(lim['raw_write_fsync_s']):>10}")
    lines.append(f"{'limit: read':<18}{'':>9}{'':>10}{_fmt(lim['raw_read_s']):>9}")
    t = point.get("targets") or {}
    if t:
        marks = {True: "met", False: "MISSED", None: "n/a"}
        lines.append("targets: " + "; ".join(
            f"{k} {_fmt(t.get(k), '.2f')} ({marks[v]})" for k, v in t["met"].items()))
    return "\n".join(lines)


def _size_groups(sizes: list[int], tolerance: float = 1.2) -> dict[int, tuple[int, int]]:
    """Each per-rank size -> the (smallest, largest) size of its group.

    A point's model width is chosen for the total, so a sweep over ranks at "128 MB per
    rank" holds 121-134 MB per rank: sizes within ``tolerance`` of their neighbours are
    one group, plotted as one line.
    """
    groups: list[list[int]] = []
    for size in sorted(set(sizes)):
        if groups and size <= groups[-1][-1] * tolerance:
            groups[-1].append(size)
        else:
            groups.append([size])
    return {size: (g[0], g[-1]) for g in groups for size in g}


def plot(points: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("--out needs matplotlib for plot.png: pip install -e '.[bench]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    group = _size_groups([p["config"]["bytes_per_rank"] for p in points])

    def value(p: dict[str, Any], key: str) -> Any:  # what a point is grouped by
        return group[p["config"][key]] if key == "bytes_per_rank" else p["config"][key]

    by_ranks = sorted({p["config"]["ranks"] for p in points})
    by_bytes = sorted({value(p, "bytes_per_rank") for p in points})
    axes_spec = []
    if len(by_ranks) > 1 or len(by_bytes) == 1:
        axes_spec.append(("ranks", "ranks"))
    if len(by_bytes) > 1:
        axes_spec.append(("bytes_per_rank", "bytes per rank (MB)"))
    fig, axes = plt.subplots(2, len(axes_spec), figsize=(6.5 * len(axes_spec), 8), squeeze=False)
    methods = list(points[0]["methods"])
    for col, (key, label) in enumerate(axes_spec):
        other = "bytes_per_rank" if key == "ranks" else "ranks"
        fixed = max({value(p, other) for p in points},
                    key=lambda v: sum(value(p, other) == v for p in points))
        pts = sorted((p for p in points if value(p, other) == fixed),
                     key=lambda p: p["config"][key])
        xs = [p["config"][key] / (1e6 if key == "bytes_per_rank" else 1) for p in pts]
        for row, (metric, limit_of, limit, title) in enumerate((
                ("stall_s", stall_limit, "host_copy", "stall (training blocked)"),
                ("durable_s", lambda lim: lim["raw_write_fsync_s"], "raw_write_fsync",
                 "durable (committed)"))):
            ax = axes[row][col]
            for m in methods:
                ax.plot(xs, [p["methods"][m][metric] for p in pts], marker="o", label=m)
            ax.plot(xs, [limit_of(p["limits"]) for p in pts], "k--", label=f"limit: {limit}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            if other == "ranks":
                fixed_label = f"{fixed} ranks"
            else:
                low, high = (f"{v / 1e6:.0f}" for v in fixed)
                fixed_label = f"{low if low == high else low + _DASH + high} MB per rank"
            ax.set_title(f"{title}, {fixed_label}")
            ax.set_xlabel(label)
            ax.set_ylabel("seconds")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"save latency on {points[0]['config']['storage']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_GOAL_TEXT = {"<=": "\u2264", ">=": "\u2265"}
_TIMES, _DASH, _MISSED = "\u00d7", "\u2013", " \u2717"  # as bench/README.md writes them


def _point_title(point: dict[str, Any]) -> str:
    c = point["config"]
    return (f"{c['ranks']} ranks {_TIMES} {c['bytes_per_rank'] / 1e6:.0f} MB per rank "
            f"({c['bytes'] / 1e6:.0f} MB, {c['tensors_per_rank']} tensors per rank, "
            f"{c['storage']}, median of {c['repeat']})")


def markdown(points: list[dict[str, Any]]) -> str:
    """The tables of ``bench/README.md`` for one results.json's points."""
    out: list[str] = []
    for point in points:
        lim = point["limits"]
        copy_s = stall_limit(lim)
        out += [f"**{_point_title(point)}**", ""]
        if point["config"].get("verl_version"):
            out += [f"verl {point['config']['verl_version']} (its own FSDPCheckpointManager)", ""]
        out += [
                "| method | stall s | durable s | load s | reshard load s (→ R/2) | durable GB/s "
                "| stall ÷ host copy |", "|---|---:|---:|---:|---:|---:|---:|"]
        for name, row in rows(point):
            out.append(f"| {name} | {_fmt(row['stall_s'])} | {_fmt(row['durable_s'])} | "
                       f"{_fmt(row['load_s'])} | "
                       f"{_fmt(row['reshard_load_s']).replace('-', _DASH)} | "
                       f"{_fmt(row['durable_gb_s'], '.2f')} | "
                       f"{row['stall_s'] / copy_s:.1f} |")
        write_gb_s = point["config"]["bytes"] / lim["raw_write_fsync_s"] / 1e9
        out += [f"| *limit: host copy* | {_fmt(copy_s)} | | | | | 1.0 |",
                f"| *limit: write + fsync* | | {_fmt(lim['raw_write_fsync_s'])} | | | "
                f"{write_gb_s:.2f} | |",
                f"| *limit: read* | | | {_fmt(lim['raw_read_s'])} | | | |", ""]
        s = point.get("step_overhead") or {}
        line = f"Host copy into fresh memory: {_fmt(lim['host_copy_fresh_s'])} s."
        if lim.get("host_copy_beside_s"):
            line = (f"Host copy measured in each round before raycheckpoint's save (the limit "
                    f"above): {_fmt(copy_s)} s; once, before the rounds: "
                    f"{_fmt(lim['host_copy_s'])} s. " + line)
        if lim.get("raw_write_direct_s") is not None:
            line += (f" Write + fsync: buffered {_fmt(lim['raw_write_buffered_s'])} s, "
                     f"O_DIRECT {_fmt(lim['raw_write_direct_s'])} s (the faster is the limit).")
        if s:
            line += (f" Training step {_fmt(s['step_s'])} s alone, "
                     f"{_fmt(s['step_during_persist_s'])} s beside a raycheckpoint persist "
                     f"({_pct(s['slowdown'], '+.0%')}), "
                     f"{_fmt(s['step_during_dcp_async_s'])} s beside a DCP async_save "
                     f"({_pct(s['dcp_async_slowdown'], '+.0%')}).")
            if s.get("overlap_stall_s") is not None:
                line += (f" With `overlap_copy`: training blocked {_fmt(s['overlap_stall_s'])} s "
                         f"({s['overlap_stall_s'] / copy_s:.2f}{_TIMES} the host copy), "
                         f"the first step after the save (beside the copy and the persist) "
                         f"{_fmt(s['overlap_first_step_s'])} s "
                         f"({_pct(s['overlap_first_step_slowdown'], '+.0%')})")
                plain = s.get("first_step_after_save_s")
                line += ("." if plain is None else
                         f"; without it the first step after a save took {_fmt(plain)} s.")
            if s.get("ride_stall_s") is not None:
                line += (f" Riding on a training step (`step_save`): training blocked "
                         f"{_fmt(s['ride_stall_s'])} s ({s['ride_stall_s'] / copy_s:.2f}{_TIMES} "
                         f"the host copy), with `overlap_copy` {_fmt(s['ride_overlap_stall_s'])} s "
                         f"({s['ride_overlap_stall_s'] / copy_s:.2f}{_TIMES}).")
        out += [line, ""]
    heads = [f"{p['config']['ranks']}{_TIMES}{p['config']['bytes_per_rank'] / 1e6:.0f} MB" for p in points]
    out += ["| target | goal | " + " | ".join(heads) + " |",
            "|---|---|" + "---:|" * len(points)]
    for key, (op, goal) in _GOALS.items():
        cells = []
        for p in points:
            t = p.get("targets") or targets(p)
            v, met = t.get(key), (t.get("met") or {}).get(key)
            cells.append(_DASH if v is None else f"{v:.2f}" + (_MISSED if met is False else ""))
        out.append(f"| {key} | {_GOAL_TEXT[op]} {goal:g} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def virtual_markdown(results: dict[str, Any]) -> str:
    """bench/README.md's table for a ``--virtual-ranks`` run's results."""
    c = results["config"]
    out = [f"Virtual ranks ({c['storage']}, {c['hosts']} host processes, {c['shard_bytes']} B "
           f"shards, median of {c['repeat']}):", "",
           "| ranks | commit overhead s | coordinator commit s | save s | verify s |",
           "|---:|---:|---:|---:|---:|"]
    for n, row in sorted(results["virtual_ranks"].items(), key=lambda kv: int(kv[0])):
        out.append(f"| {n} | {row['commit_overhead_s']:.3f} | {row['commit_s']:.3f} | "
                   f"{row['save_s']:.3f} | {row['verify_s']:.3f} |")
    g = results.get("growth")
    if g:
        out += ["", f"Growth {g['ranks'][0]} → {g['ranks'][1]} ranks ({_TIMES}{g['ranks_ratio']:.0f}): "
                f"commit overhead {_TIMES}{g['commit_overhead_ratio']:.2f}, coordinator commit "
                f"{_TIMES}{g['commit_s_ratio']:.2f}."]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json
    import os

    p = argparse.ArgumentParser(description="Print bench/README.md's tables for results.json files.")
    p.add_argument("results", nargs="+", help="results.json written by bench.save_latency --out")
    p.add_argument("--plot", action="store_true",
                   help="also redraw plot.png beside each results.json")
    args = p.parse_args(argv)
    for path in args.results:
        with open(path) as f:
            doc = json.load(f)
        if "virtual_ranks" in doc:  # a --virtual-ranks run: coordination, no methods
            print(virtual_markdown(doc))
            print()
            continue
        points = doc.get("points") or [doc]
        print(markdown(points))
        print()
        if args.plot:
            plot(points, os.path.join(os.path.dirname(path) or ".", "plot.png"))


if __name__ == "__main__":
    main()
