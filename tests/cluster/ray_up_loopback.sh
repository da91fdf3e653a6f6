#!/usr/bin/env bash
# `ray up` / job / `ray down` / `ray up` / resumed job / `ray down`, over real ssh to 127.0.0.1.
#
# Run by tests/test_cluster.py inside fresh net+pid+mount namespaces: only loopback
# exists, every process (sshd, the Ray head `ray up` starts, `ray stop` from `ray down`)
# sees only this namespace; root's home (in a private copy of /etc/passwd) and /tmp are
# directories under WORK (see private_tmp).
# Usage: ray_up_loopback.sh WORK CONFIG   (CONFIG: the cluster yaml to bring up)
set -euo pipefail
WORK=$1; CONFIG=$2
REPO=$(cd "$(dirname "$0")/../.." && pwd)
VENV_BIN=$(dirname "$(command -v python)")
source "$REPO/tests/cluster/end_processes.sh"
trap end_processes EXIT  # what `ray down` left (agents, workers) ends before WORK is removed
ip link set lo up
export HOME="$WORK/home"
mkdir -p "$HOME/.ssh" "$WORK/ssh" /run/sshd
sed "s#^root:\([^:]*\):0:0:\([^:]*\):[^:]*:#root:\1:0:0:\2:$HOME:#" /etc/passwd > "$WORK/passwd"
mount --bind "$WORK/passwd" /etc/passwd

private_tmp() {  # private_tmp VIEW PATH...: VIEW is /tmp from now on; each PATH under /tmp
  local view=$1 p; shift  # is still seen at its own path
  mkdir -p "$view" && chmod 1777 "$view"
  for p in "$@"; do
    case $p in /tmp/*) mkdir -p "$view/${p#/tmp/}"; mount --bind "$p" "$view/${p#/tmp/}" ;; esac
  done
  mount --rbind "$view" /tmp
}
# /tmp of this run's own: Ray's default temporary directory /tmp/ray (the other Ray's
# below, and the cluster lock and state that Ray's local provider keeps there for `ray up`
# and for the head's autoscaler, whose ssh shells have no TMPDIR), deploy/cluster-local.yaml's
# /tmp/raycheckpoint-ray-<uid> and ray's ssh control sockets (/tmp/ray_ssh_*) are under
# WORK/tmp; nothing in the machine's /tmp is read or written
private_tmp "$WORK/tmp" "$WORK" "$REPO"
export TMPDIR=/tmp
unset RAY_TMPDIR
mkdir -p /tmp/ray
ssh-keygen -q -t ed25519 -N '' -f "$WORK/ssh/host_key"
ssh-keygen -q -t ed25519 -N '' -f "$HOME/.ssh/id_ed25519"
cp "$HOME/.ssh/id_ed25519.pub" "$HOME/.ssh/authorized_keys"
chmod 700 "$HOME/.ssh"; chmod 600 "$HOME/.ssh/authorized_keys"
# a non-interactive ssh shell must find `ray` and this project's Python, and
# deploy/bin/ray first, as the config's setup_commands arrange on a real node
echo "export PATH=\"$REPO/deploy/bin:$VENV_BIN:\$PATH\"" > "$HOME/.bashrc"
cat > "$WORK/ssh/sshd_config" <<CFG
ListenAddress 127.0.0.1
Port 22
HostKey $WORK/ssh/host_key
PidFile $WORK/ssh/sshd.pid
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
AuthorizedKeysFile $HOME/.ssh/authorized_keys
CFG
/usr/sbin/sshd -f "$WORK/ssh/sshd_config" -E "$WORK/ssh/sshd.log"
for _ in $(seq 50); do ssh -q -o BatchMode=yes -o StrictHostKeyChecking=no \
  -o UserKnownHostsFile=/dev/null -i "$HOME/.ssh/id_ed25519" root@127.0.0.1 true && break; sleep 0.2; done

CKPT="$WORK/checkpoints"
JOB=(python -m drivers.main_ppo "trainer.default_local_dir=$CKPT" trainer.save_freq=2
     trainer.n_gpus_per_node=1 data.train_batch_size=4 actor_rollout_ref.rollout.n=2)
cd "$REPO"
step() {  # step NAME COMMAND...: output to $WORK/NAME.log; its tail if it fails; its duration
  local name=$1 start=$SECONDS; shift
  "$@" > "$WORK/$name.log" 2>&1 || { echo "$name failed:"; tail -60 "$WORK/$name.log"; exit 1; }
  echo "== $name: $((SECONDS - start)) s"
}
submit() { ray job submit --address http://127.0.0.1:8265 --working-dir . -- "${JOB[@]}" "$@"; }
# someone else's Ray on the same machine: `ray down` must leave it running
# (at Ray's default /tmp/ray, this run's own here; on ports of its own)
step other ray start --head --port=6390 --num-cpus=1 --include-dashboard=false \
  --dashboard-port=8266 --ray-client-server-port=9002 --dashboard-agent-listen-port=52366 \
  --min-worker-port=20000 --max-worker-port=20999
OTHER=$(pgrep -f "gcs_server.*--gcs_server_port=6390" | head -1)
[ -n "$OTHER" ] || { echo "the other Ray's gcs_server not found"; exit 1; }
step up1 ray up -y --no-config-cache "$CONFIG"
step job1 submit trainer.total_training_steps=4
step down1 ray down -y "$CONFIG"
if ray status --address 127.0.0.1:6379 > /dev/null 2>&1; then echo "cluster still up after ray down"; ps -eo pid,ppid,args | cut -c1-200; exit 1; fi
kill -0 "$OTHER" || { echo "ray down ended another Ray on the machine (gcs_server $OTHER)"; exit 1; }
ray status --address 127.0.0.1:6390 > /dev/null || { echo "the other Ray no longer answers"; exit 1; }
echo "== other Ray still up after ray down: gcs_server $OTHER"
raycheckpoint ls "$CKPT" --json > "$WORK/ls1.json"
step up2 ray up -y --no-config-cache "$CONFIG"
step job2 submit trainer.total_training_steps=6
step down2 ray down -y "$CONFIG"
grep -hE "^resumed from|^checkpoint step_" "$WORK/job1.log" "$WORK/job2.log" || true
raycheckpoint verify "$CKPT" --json > "$WORK/verify.json" || true
kill "$(cat "$WORK/ssh/sshd.pid")"
echo "== done"
