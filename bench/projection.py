"""Project save stall and durable time to 256 GPUs, calibrated by a measured run.

    python -m bench.projection --results bench/results/size/results.json \\
        [--virtual bench/results/virtual/results.json] [--gpu-check OUT/gpu_check.json]

A model: every figure is (bytes to move) / (bandwidth that moves them), times the
ratio this project measured against the same limit on a real machine (its overhead
over a plain copy, over a plain write), plus the measured commit overhead at 256
ranks.  The hardware figures are assumptions, printed with the table; change them
with the flags.  Nothing here is a measurement of a GPU cluster.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from bench.report import stall_limit

STATE_BYTES_PER_PARAM = 12  # fp32 weights + AdamW exp_avg + exp_avg_sq (FSDP, as verl)


@dataclass(frozen=True)
class Hardware:
    name: str
    gpus_per_node: int
    d2h_gb_s: float  # pinned device-to-host per GPU, with all GPUs of a node copying at once
    node_write_gb_s: float  # what one node can push to the checkpoint storage
    storage_gb_s: float  # the storage's aggregate write bandwidth


HARDWARE = {
    "A100": Hardware("A100 (PCIe Gen4)", 8, 12.0, 5.0, 40.0),
    "H100": Hardware("H100 (PCIe Gen5)", 8, 25.0, 10.0, 80.0),
}
MODELS = {"7B": 7e9, "70B": 70e9}
# tiered saves (--tiers): assumptions, per node.  NVMe: vendor datasheets of PCIe Gen4
# data-center SSDs give 2-4 GB/s sequential write per drive; 8 GB/s is a node striping 2-4
# of them (8-GPU instances carry 4-8).  S3: the highest per-instance throughput measured by
# s3-benchmark (github.com/dvassallo/s3-benchmark, 2019, all EC2 types) was 6.3 GB/s on a
# p3dn.24xlarge (8 V100) and 8.0 GB/s on a c5n.18xlarge; S3 scales with prefixes, so the
# aggregate is taken as nodes x per-node.
NVME_GB_S = 8.0
S3_NODE_GB_S = 6.0


def project(params: float, gpus: int, hw: Hardware, calib: dict[str, float]) -> dict[str, float]:
    total = params * STATE_BYTES_PER_PARAM
    per_gpu = total / gpus
    nodes = gpus / hw.gpus_per_node
    copy_s = per_gpu / (hw.d2h_gb_s * 1e9)
    # a synchronous write of everyone's shard: bounded by each node's link and by the storage
    write_s = max(per_gpu * hw.gpus_per_node / (hw.node_write_gb_s * 1e9),
                  total / (hw.storage_gb_s * 1e9))
    gather_s = total / (hw.node_write_gb_s * 1e9)  # rank 0's node writes everything
    return {
        "bytes_per_gpu": per_gpu, "nodes": nodes,
        "limit_copy_s": copy_s, "limit_write_s": write_s,
        "raycheckpoint_stall_s": copy_s * calib["stall_over_host_copy"],
        # overlap_copy: what the GPU check measured blocking beside the running step
        "raycheckpoint_overlap_stall_s": copy_s * calib.get("overlap_stall_over_host_copy", float("nan")),
        "raycheckpoint_durable_s": write_s * calib["durable_over_raw_write"]
        + calib["commit_overhead_256_s"],
        "verl_sync_stall_s": write_s * calib["verl_over_raw_write"],
        "rank0_gather_stall_s": gather_s * calib["rank0_over_raw_write"],
    }


def calibrate_from_gpu_check(calib: dict[str, float], gpu: dict) -> dict[str, float]:
    """The stall ratio measured on a GPU by ``scripts/gpu_check.sh`` (its largest size per
    rank) in place of the CPU run's, and the overlap mode's beside it."""
    if gpu.get("mode") != "cuda" or not gpu.get("stall"):
        raise SystemExit("--gpu-check: not the result of a run on a GPU (gpu_check.json mode cuda)")
    row = max(gpu["stall"], key=lambda r: r["gb_per_rank"])
    return {**calib, "stall_over_host_copy": max(1.0, row["stall_ratio"]),
            "overlap_stall_over_host_copy": row["overlap_ratio"]}


def calibration(results: dict, virtual: dict | None) -> dict[str, float]:
    m, lim = results["methods"], results["limits"]
    raw = lim["raw_write_fsync_s"]
    out = {"stall_over_host_copy": m["raycheckpoint"]["stall_s"] / stall_limit(lim),
           "durable_over_raw_write": m["raycheckpoint"]["durable_s"] / raw,
           # verl's save as it returns (its own manager's, else the imitation's): no fsync
           "verl_over_raw_write": (m["verl"]["returned_s"] if "verl" in m
                                   else m["verl_sync"]["durable_s"]) / raw,
           # rank 0 writes all ranks' bytes: compare with one rank's raw write of all of them
           "rank0_over_raw_write": m["rank0_gather"]["durable_s"] / (raw * results["config"]["ranks"]),
           "commit_overhead_256_s": 0.0}
    # a method cannot beat the machine's limit: a ratio under 1 says the limit's own
    # measurement was slow that time (a shared disk's speed moves between the two)
    for key in ("stall_over_host_copy", "durable_over_raw_write", "verl_over_raw_write",
                "rank0_over_raw_write"):
        out[key] = max(1.0, out[key])
    if virtual is not None:
        row = virtual["virtual_ranks"].get("256")
        if row is None:
            raise SystemExit("the --virtual results have no 256-rank row")
        out["commit_overhead_256_s"] = row["commit_overhead_s"]
    return out


def project_tiers(params: float, gpus: int, hw: Hardware, ratio: float, nvme_gb_s: float,
                  s3_gb_s: float) -> dict[str, float]:
    """A tiered save: committed on each node's NVMe, then each node uploads its own ranks'
    files to S3; against the same save straight to S3 (each node's link to S3)."""
    node_bytes = params * STATE_BYTES_PER_PARAM / gpus * hw.gpus_per_node
    return {"local_commit_s": node_bytes / (nvme_gb_s * 1e9) * ratio,
            "s3_s": node_bytes / (s3_gb_s * 1e9)}


def print_tiers(path: str, gpus: int, hardware: list[Hardware], nvme_gb_s: float,
                s3_gb_s: float) -> None:
    with open(path) as f:
        ratio = max(1.0, json.load(f)["ratios"]["local_commit_ratio"])
    print(f"\ntiered (calibration: local commit {ratio:.2f}x a write + fsync, measured): the time "
          "to a committed checkpoint, and to the same bytes in S3")
    print(f"{'model':<6}{'GPU':<18}{'GB/node':>8}{'local commit':>13}{'in S3':>8}")
    for hw in hardware:
        for model, params in MODELS.items():
            r = project_tiers(params, gpus, hw, ratio, nvme_gb_s, s3_gb_s)
            node_gb = params * STATE_BYTES_PER_PARAM / gpus * hw.gpus_per_node / 1e9
            print(f"{model:<6}{hw.name:<18}{node_gb:>8.2f}{r['local_commit_s']:>12.2f}s"
                  f"{r['s3_s']:>7.2f}s")
    print(f"assumptions: NVMe {nvme_gb_s} GB/s per node, S3 {s3_gb_s} GB/s per node "
          "(sources in bench/projection.py); the upload runs beside training and the "
          "checkpoint is restorable from the local tier as soon as it is committed there.")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", required=True, help="results.json of bench.save_latency")
    p.add_argument("--virtual", default=None, help="results.json of a --virtual-ranks run")
    p.add_argument("--gpus", type=int, default=256)
    p.add_argument("--gpu-check", default=None,
                   help="gpu_check.json of scripts/gpu_check.sh on a GPU: its measured stall ratio")
    for key, hw in HARDWARE.items():
        p.add_argument(f"--{key.lower()}-d2h-gb-s", type=float, default=hw.d2h_gb_s)
        p.add_argument(f"--{key.lower()}-node-write-gb-s", type=float, default=hw.node_write_gb_s)
        p.add_argument(f"--{key.lower()}-storage-gb-s", type=float, default=hw.storage_gb_s)
    p.add_argument("--tiers", default=None,
                   help="results.json of bench.save_latency --tiers: add the tiered projection")
    p.add_argument("--nvme-gb-s", type=float, default=NVME_GB_S)
    p.add_argument("--s3-node-gb-s", type=float, default=S3_NODE_GB_S)
    args = p.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    virtual = None
    if args.virtual:
        with open(args.virtual) as f:
            virtual = json.load(f)
    calib = calibration(results, virtual)
    if args.gpu_check:
        with open(args.gpu_check) as f:
            calib = calibrate_from_gpu_check(calib, json.load(f))
    print("calibration (measured; a ratio under 1 counts as 1): "
          + ", ".join(f"{k} {v:.2f}" for k, v in calib.items()))
    print(f"\n{'model':<6}{'GPU':<18}{'GB/GPU':>7}{'copy limit':>11}{'write limit':>12}"
          f"{'ours stall':>11}{'ours durable':>13}{'verl sync':>10}{'rank0 gather':>13}")
    hardware = [Hardware(base.name, base.gpus_per_node, getattr(args, f"{key.lower()}_d2h_gb_s"),
                         getattr(args, f"{key.lower()}_node_write_gb_s"),
                         getattr(args, f"{key.lower()}_storage_gb_s"))
                for key, base in HARDWARE.items()]
    for hw in hardware:
        for model, params in MODELS.items():
            r = project(params, args.gpus, hw, calib)
            print(f"{model:<6}{hw.name:<18}{r['bytes_per_gpu'] / 1e9:>7.2f}{r['limit_copy_s']:>10.2f}s"
                  f"{r['limit_write_s']:>11.1f}s{r['raycheckpoint_stall_s']:>10.2f}s"
                  f"{r['raycheckpoint_durable_s']:>12.1f}s{r['verl_sync_stall_s']:>9.1f}s"
                  f"{r['rank0_gather_stall_s']:>12.1f}s")
            if "overlap_stall_over_host_copy" in calib:
                print(f"{'':<6}{'':<18}with checkpoint.overlap_copy: stall "
                      f"{r['raycheckpoint_overlap_stall_s']:.3f}s")
    print("\nassumptions: " + "; ".join(
        f"{hw.name}: {hw.gpus_per_node} GPUs/node, D2H {hw.d2h_gb_s} GB/s per GPU, node write "
        f"{hw.node_write_gb_s} GB/s, storage {hw.storage_gb_s} GB/s aggregate"
        for hw in hardware)
        + f"; {STATE_BYTES_PER_PARAM} bytes of state per parameter; {args.gpus} GPUs, FSDP full "
        "shard.")
    if args.tiers:
        print_tiers(args.tiers, args.gpus, hardware, args.nvme_gb_s, args.s3_node_gb_s)


if __name__ == "__main__":
    main()
