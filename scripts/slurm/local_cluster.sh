#!/usr/bin/env bash
# A real two-node Slurm cluster on this one machine, for trying scripts/slurm/train.sbatch and for the
# tests (tests/integration/test_slurm.py). Needs root, iproute2, util-linux and Debian's packages
# slurmctld slurmd slurm-client munge (apt-get install -y --no-install-recommends ...).
#
#   scripts/slurm/local_cluster.sh up DIR              # start; DIR holds all state (made if missing)
#   scripts/slurm/local_cluster.sh exec DIR CMD ...    # a client command on the controller (sbatch, squeue, ...)
#   scripts/slurm/local_cluster.sh kill-node DIR N     # node N (1 or 2) dies: SIGKILL every process on it
#   scripts/slurm/local_cluster.sh start-node DIR N    # node N's slurmd starts again
#   scripts/slurm/local_cluster.sh cut-link DIR N      # node N vanishes from the network: its link goes down
#   scripts/slurm/local_cluster.sh restore-link DIR N  # its link comes back up
#   scripts/slurm/local_cluster.sh down DIR            # stop everything, remove every namespace and file made
#
# Layout: three network namespaces, wm<TAG>-ctl, wm<TAG>-node1, wm<TAG>-node2 (TAG random per cluster,
# kept in DIR/cluster.env). The controller's namespace holds a bridge (10.213.0.1/24) and one veth
# pair per node into the node's namespace (node1 10.213.0.11, node2 10.213.0.12). No address or link
# is added to the machine's own namespace and no namespace has a route beyond 10.213.0.0/24: nothing
# leaves the machine, and the fixed ports (6817, 6818) cannot collide with anything outside. IPv6 is
# off in the three namespaces (no link-local addresses either). Each daemon runs in its namespace
# under `unshare --mount --uts` with its own hostname (ctl, node1, node2) and DIR/hosts bound over
# /etc/hosts in its private mount namespace (the machine's /etc/hosts is untouched), so the names
# resolve to those addresses. Jobs and their tasks inherit the node's namespaces, hostname and hosts
# file, so a torch.distributed rendezvous really crosses from one "host" to the other
# (MASTER_ADDR=node1, the first node of the job's node list, resolves to 10.213.0.11 on both nodes).
# One munged (in the controller's namespace) serves all three: munge talks over a Unix socket in DIR.
# slurm.conf: SlurmUser=root, no cgroups (proctrack/linuxproc), 6 CPUs per node declared whatever the
# machine has (several small jobs side by side), AuthInfo cred_expire=10 (a requeued job may start
# again after 11 s instead of 121 s), SlurmdTimeout=30, KillWait=5, ReturnToService=2 (a node set
# DOWN returns when its slurmd registers again).
# cut-link sets both ends of node N's veth pair down: packets to and from it are dropped without a reset,
# as after a power loss or a cut cable (no process on either side learns of it until a timeout).
#
# `down` ends every process still in the three namespaces (the daemons and whatever jobs left behind)
# by pid, TERM then KILL, and deletes the namespaces (their bridge and veth pairs go with them); it is
# idempotent, and `up` runs it itself when it fails halfway. DIR itself is left to the caller.

set -euo pipefail

SUBNET=10.213.0
PATH=$PATH:/usr/sbin:/sbin

die() { echo "local_cluster.sh: $*" >&2; exit 1; }

load() {  # the cluster's names, from DIR/cluster.env
  DIR=$(realpath -m "$1")
  ENVFILE=$DIR/cluster.env
  if [[ -f $ENVFILE ]]; then
    # shellcheck disable=SC1090
    source "$ENVFILE"
  fi
}

ns() { echo "wm${TAG}-$1"; }

in_ns() {  # in_ns NAME CMD...: CMD detached in that namespace, under its own hostname NAME and hosts file
  local name=$1
  shift
  # a private mount namespace: the hosts file is bound over /etc/hosts for this node's processes only
  setsid nsenter --net="/run/netns/$(ns "$name")" unshare --mount --uts \
    sh -c 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"' "$DIR/hosts" "$name" "$@" \
    </dev/null >>"$DIR/log/$name.out" 2>&1 &
}

wait_for_file() {
  local f=$1 i
  for ((i = 0; i < 200; i++)); do [[ -s $f ]] && return 0; sleep 0.1; done
  die "$f did not appear; see $DIR/log/"
}

write_conf() {
  cat >"$DIR/slurm.conf" <<EOF
ClusterName=wmlocal
FirstJobId=$((RANDOM % 900 + 100))000
SlurmctldHost=ctl($SUBNET.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket.2,cred_expire=10
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SlurmdTimeout=30
KillWait=5
SlurmdParameters=config_overrides
NodeName=node1 NodeAddr=$SUBNET.11 CPUs=6 RealMemory=4000 State=UNKNOWN
NodeName=node2 NodeAddr=$SUBNET.12 CPUs=6 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP
EOF
}

network() {
  local ctl n
  ctl=$(ns ctl)
  ip netns add "$ctl"
  ip netns exec "$ctl" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
  ip -n "$ctl" link set lo up
  ip -n "$ctl" link add br0 type bridge
  ip -n "$ctl" addr add "$SUBNET.1/24" dev br0
  ip -n "$ctl" link set br0 up
  for n in 1 2; do
    ip netns add "$(ns node$n)"
    ip netns exec "$(ns node$n)" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
    ip -n "$(ns node$n)" link set lo up
    ip -n "$ctl" link add "v$n" type veth peer name eth0 netns "$(ns node$n)"
    ip -n "$ctl" link set "v$n" master br0 up
    ip -n "$(ns node$n)" addr add "$SUBNET.1$n/24" dev eth0
    ip -n "$(ns node$n)" link set eth0 up
  done
  printf '127.0.0.1 localhost\n%s.1 ctl\n%s.11 node1\n%s.12 node2\n' "$SUBNET" "$SUBNET" "$SUBNET" >"$DIR/hosts"
}

start_node() {
  local n=$1
  rm -f "$DIR/slurmd-node$n.pid"
  in_ns "node$n" slurmd -f "$DIR/slurm.conf" -N "node$n"
  wait_for_file "$DIR/slurmd-node$n.pid"
}

up() {
  [[ $(id -u) == 0 ]] || die "needs root (network namespaces, SlurmUser=root)"
  for b in munged mungekey slurmctld slurmd sbatch srun scontrol sinfo ip unshare; do
    command -v "$b" >/dev/null || die "$b not found: apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge"
  done
  [[ ! -f $ENVFILE ]] || die "$DIR already holds a cluster (cluster.env): run down first"
  mkdir -p "$DIR"/{munge,state,spool/node1,spool/node2,log}
  chmod 755 "$DIR" "$DIR/munge"  # munged refuses a socket folder only its owner can enter
  TAG=$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')
  printf 'TAG=%s\nSLURM_CONF=%s\n' "$TAG" "$DIR/slurm.conf" >"$ENVFILE"
  trap 'echo "local_cluster.sh: up failed; cleaning up" >&2; down' EXIT
  network
  write_conf
  mungekey -c -k "$DIR/munge/munge.key" -b 1024 && chmod 400 "$DIR/munge/munge.key"
  in_ns ctl munged --foreground --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket.2" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munge.seed"
  wait_for_file "$DIR/munge/munged.pid"
  in_ns ctl slurmctld -f "$DIR/slurm.conf"
  wait_for_file "$DIR/slurmctld.pid"
  start_node 1
  start_node 2
  local i state=""
  for ((i = 0; i < 300; i++)); do
    state=$(client sinfo -h -N -o '%N=%t' 2>/dev/null | sort | tr '\n' ' ' || true)
    [[ $state == "node1=idle node2=idle " ]] && break
    sleep 0.2
  done
  [[ $state == "node1=idle node2=idle " ]] || { echo "nodes not idle: $state" >&2; false; }
  trap - EXIT
  echo "up: $DIR/slurm.conf; namespaces $(ns ctl) $(ns node1) $(ns node2); nodes node1 ($SUBNET.11) node2 ($SUBNET.12)"
}

client() { SLURM_CONF=$DIR/slurm.conf nsenter --net="/run/netns/$(ns ctl)" "$@"; }

kill_ns() {  # kill_ns NAME SIGNAL: signal every process in that namespace, by pid
  local pids
  pids=$(ip netns pids "$(ns "$1")" 2>/dev/null | tr '\n' ' ' || true)
  [[ -z ${pids// /} ]] || kill -s "$2" $pids 2>/dev/null || true
}

down() {
  [[ -n ${TAG:-} ]] || return 0
  local n i
  for n in node1 node2 ctl; do kill_ns "$n" TERM; done
  for ((i = 0; i < 50; i++)); do
    [[ -z $(for n in node1 node2 ctl; do ip netns pids "$(ns $n)" 2>/dev/null; done) ]] && break
    sleep 0.2
  done
  for n in node1 node2 ctl; do kill_ns "$n" KILL; done
  for n in node1 node2 ctl; do
    ip netns del "$(ns $n)" 2>/dev/null || true
  done
  rm -f "$ENVFILE"
}

cmd=${1:-}
[[ $# -ge 2 ]] || die "usage: $0 up|down|exec|kill-node|start-node|cut-link|restore-link DIR [...]"
load "$2"
shift 2
case "$cmd" in
  up) up ;;
  down) down ;;
  exec) [[ -n ${TAG:-} ]] || die "no cluster in $DIR"; client "$@" ;;
  kill-node) [[ -n ${TAG:-} ]] || die "no cluster in $DIR"; kill_ns "node${1:?node number}" KILL ;;
  start-node) [[ -n ${TAG:-} ]] || die "no cluster in $DIR"; start_node "${1:?node number}" ;;
  cut-link | restore-link)
    [[ -n ${TAG:-} ]] || die "no cluster in $DIR"
    state=$([[ $cmd == cut-link ]] && echo down || echo up)
    ip -n "$(ns ctl)" link set "v${1:?node number}" "$state"
    ip -n "$(ns "node$1")" link set eth0 "$state"
    ;;
  *) die "unknown command $cmd (up, down, exec, kill-node, start-node, cut-link, restore-link)" ;;
esac
