"""Training's stall against ``checkpoint.host_buffer_bytes`` (``save_latency --host-buffer-bytes``).

A rank whose shard exceeds its budget stages no host copy: it writes its tensors through
a buffer of that size, training blocked until the last chunk is written.  One row per
budget (and one with none) on the benchmark's worker group.
"""

from __future__ import annotations

from typing import Any

from bench._harness import TIMEOUT_S, BenchStorage, _median
from raycheckpoint import CheckpointConfig, CheckpointManager


def budget_stalls(group: list[Any], storage: BenchStorage, budgets: list[int], saves: int = 3,
                  log=print) -> list[dict[str, Any]]:
    """Training's stall per save against ``checkpoint.host_buffer_bytes``: no budget, then
    each of ``budgets`` (a rank over its budget writes through a buffer of that size while
    training waits).  One row per budget: the median stall over ``saves`` saves after a
    warm-up, the most host memory a rank's save held, and whether ranks wrote in chunks."""
    rows = []
    for budget in [None, *budgets]:
        name = f"raycheckpoint-budget-{budget or 'none'}"
        cfg = CheckpointConfig(save_dir=storage.url(name), storage_options=storage.options,
                               keep_last_n=1, publish_metrics=False, commit_timeout_s=TIMEOUT_S,
                               rpc_timeout_s=TIMEOUT_S, job_name=f"bench-{name}",
                               host_buffer_bytes=budget)
        m = CheckpointManager(cfg, {"actor": group})
        try:
            for i in range(saves + 1):
                m.update(step=i + 1)
                m.save_checkpoint().wait(TIMEOUT_S)
            stats = m.checkpoint_stats[1:]  # the first save warms up
        finally:
            m.close(TIMEOUT_S)
            storage.remove(name)
        row = {"host_buffer_bytes": budget, "stall_s": _median([s["stall_s"] for s in stats]),
               "host_bytes": max(s.get("host_bytes", 0) for s in stats),
               "pinned_bytes": max(s.get("pinned_bytes", 0) for s in stats),
               "chunked": any(s.get("chunked") for s in stats)}
        log(f"   host_buffer_bytes {'none' if budget is None else f'{budget / 2**20:g} MiB'}: "
            f"stall {row['stall_s']:.3f} s, host memory per rank {row['host_bytes'] / 1e6:.0f} MB "
            f"(pinned {row['pinned_bytes'] / 1e6:.0f} MB), "
            f"{'written in chunks' if row['chunked'] else 'staged'}")
        rows.append(row)
    return rows
