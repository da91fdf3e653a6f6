#!/usr/bin/env bash
# Autoscaling with checkpointing across nodes on Ray's fake multi-node cluster.
#
# Run by tests/test_cluster.py inside fresh net+pid+mount namespaces (only loopback;
# every raylet the autoscaler starts ends with the namespace).  The head has no GPU; the
# autoscaler starts one worker node (4 declared GPUs) and, once the job's ranks ask for a
# GPU each (trainer.device=auto on a cluster with GPUs), adds another: STRICT_SPREAD puts
# the two ranks of each role on different nodes.  Job 1 saves at steps 2 and 4; job 2
# resumes from step 4 (on nodes scaled up again if the idle ones were removed).  Then the
# latency benchmark runs as a job with its ranks placed the same way.
# Usage: fake_multinode.sh WORK
set -euo pipefail
WORK=$1
REPO=$(cd "$(dirname "$0")/../.." && pwd)
ip link set lo up
export HOME="$WORK/home"; mkdir -p "$HOME"
cd "$REPO"
source "$REPO/tests/cluster/end_processes.sh"
RAY_TMP=$(mktemp -d /tmp/rcfake.XXXXXX)  # short: Ray's socket paths must fit in 107 bytes
# Ray's processes write into RAY_TMP until they end: end them (by PID), then remove it
trap 'end_processes; rm -rf "$RAY_TMP"' EXIT
RAY_FAKE_CLUSTER=1 ray start --head --node-ip-address=127.0.0.1 --port=6379 \
  --dashboard-host=127.0.0.1 --autoscaling-config=deploy/cluster-fake.yaml \
  --temp-dir="$RAY_TMP" > "$WORK/start.log" 2>&1 || { tail -30 "$WORK/start.log"; exit 1; }
# the job decides its device from the GPUs the cluster has: wait for the first worker node
for _ in $(seq 120); do
  ray status --address 127.0.0.1:6379 2>/dev/null | grep -q "GPU" && break
  sleep 1
done
CKPT="$WORK/checkpoints"
# no --working-dir: fake nodes share one session directory, and one node's runtime-env
# cleanup can remove a working_dir another node's workers run in; the project is
# installed in the environment instead
JOB=(python -m drivers.main_ppo "trainer.default_local_dir=$CKPT" trainer.save_freq=2
     trainer.device=auto trainer.placement_strategy=STRICT_SPREAD)
for steps in 4 6; do
  echo "== job: $steps steps"
  ray job submit --address http://127.0.0.1:8265 -- "${JOB[@]}" \
    "trainer.total_training_steps=$steps" > "$WORK/job$steps.log" 2>&1 \
    || { tail -60 "$WORK/job$steps.log"; exit 1; }
  grep -E "^worker groups placed|^GPUs per rank|^ranks compute on|^resumed from|^checkpoint step_" \
    "$WORK/job$steps.log" || true
  ray status --address 127.0.0.1:6379 > "$WORK/status$steps.log" 2>&1 || true
done
# the latency benchmark as a job: its two ranks placed by resources on two nodes
echo "== bench job"
ray job submit --address http://127.0.0.1:8265 -- python -m bench.save_latency --ranks 2 \
  --bytes-per-rank 1MB --repeat 1 --methods raycheckpoint,dcp_sync --step-batch 1 --step-seq 8 \
  --worker-resources '{"trainer_slot": 1}' --placement-strategy STRICT_SPREAD \
  --storage "$WORK/bench" > "$WORK/bench.log" 2>&1 || { tail -60 "$WORK/bench.log"; exit 1; }
grep -E "^== 2 ranks" "$WORK/bench.log" || true
# no `ray stop`: the EXIT trap ends what this script started, by PID, in its own namespace
echo "== done"
