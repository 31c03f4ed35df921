#!/usr/bin/env bash
# A one-machine SLURM cluster for tests/integration/test_slurm.py (idempotent; root only).
#
#   scripts/setup_slurm.sh [STATE_DIR]        (default /tmp/bpsl-slurm)
#
# Installs Debian's slurm-wlm when sbatch is missing, starts munged (creating a key when there
# is none), writes STATE_DIR/slurm.conf describing this machine as the only node (from
# `slurmd -C`), starts slurmctld and slurmd with it when they are not answering, and waits until
# the node is idle. The last line of output is `SLURM_CONF=STATE_DIR/slurm.conf`; clients (sbatch,
# sinfo) need it in their environment. Exits non-zero, saying why, when anything fails.
# Stop it with: scripts/setup_slurm.sh --stop [STATE_DIR]
set -euo pipefail

if [[ "${1:-}" == "--stop" ]]; then
    STATE=${2:-/tmp/bpsl-slurm}
    for pidfile in "$STATE/slurmd.pid" "$STATE/slurmctld.pid"; do
        [[ -s "$pidfile" ]] && kill "$(cat "$pidfile")" 2>/dev/null || true
    done
    exit 0
fi
STATE=${1:-/tmp/bpsl-slurm}
say() { echo "setup_slurm: $*" >&2; }
die() { say "error: $*"; exit 1; }

[[ $(id -u) == 0 ]] || die "needs root (installs packages, runs slurmd as root)"
if ! command -v sbatch >/dev/null || ! command -v slurmctld >/dev/null \
        || ! command -v slurmd >/dev/null; then
    command -v apt-get >/dev/null || die "slurm is not installed and there is no apt-get"
    say "installing slurm-wlm (Debian packages)"
    export DEBIAN_FRONTEND=noninteractive
    # another apt (a fresh VM's unattended upgrades) may hold dpkg's lock: wait up to 10 min
    apt-get -o DPkg::Lock::Timeout=600 update -qq >&2 || die "apt-get update failed"
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq slurm-wlm >&2 \
      || die "apt-get install slurm-wlm failed"
fi

# munge: SLURM's authentication
if [[ ! -s /etc/munge/munge.key ]]; then
    mkdir -p /etc/munge
    if command -v mungekey >/dev/null; then mungekey --create --force >&2
    else dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
fi
chown -R munge:munge /etc/munge 2>/dev/null || true
chmod 0400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    say "starting munged"
    if id munge >/dev/null 2>&1; then runuser -u munge -- /usr/sbin/munged >&2 \
        || die "munged did not start"
    else /usr/sbin/munged --force >&2 || die "munged did not start"; fi
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n | unmunge >/dev/null 2>&1 || die "munge does not answer after starting munged"
fi

mkdir -p "$STATE/spool" "$STATE/state"
CONF="$STATE/slurm.conf"
NODE_LINE=$(slurmd -C 2>/dev/null | head -1) || die "slurmd -C failed"
[[ "$NODE_LINE" == NodeName=* ]] || die "slurmd -C printed no NodeName line: $NODE_LINE"
NODE=${NODE_LINE#NodeName=}; NODE=${NODE%% *}
cat > "$CONF.new" <<CONFEOF
# written by scripts/setup_slurm.sh: a one-node cluster on $NODE
ClusterName=bpsl
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
$NODE_LINE NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONFEOF
mv "$CONF.new" "$CONF"
export SLURM_CONF="$CONF"

running() { [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
if ! running "$STATE/slurmctld.pid"; then
    say "starting slurmctld"
    slurmctld -f "$CONF" >&2 || die "slurmctld did not start (see $STATE/slurmctld.log)"
fi
if ! running "$STATE/slurmd.pid"; then
    say "starting slurmd"
    slurmd -f "$CONF" >&2 || die "slurmd did not start (see $STATE/slurmd.log)"
fi
for _ in $(seq 60); do
    state=$(sinfo -h -N -o %t 2>/dev/null | head -1 || true)
    [[ "$state" == idle* || "$state" == mix* || "$state" == alloc* ]] && break
    sleep 0.5
done
[[ "$state" == idle* || "$state" == mix* || "$state" == alloc* ]] || die \
    "node $NODE is not up (sinfo state '${state:-none}'); last slurmd log lines: $(tail -3 "$STATE/slurmd.log" 2>/dev/null | tr '\n' ' ') slurmctld: $(tail -3 "$STATE/slurmctld.log" 2>/dev/null | tr '\n' ' ')"
say "node $NODE is $state"
echo "SLURM_CONF=$CONF"
