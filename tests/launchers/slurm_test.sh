#!/usr/bin/env bash
# A single-node Slurm (munged + slurmctld + slurmd from Debian's slurm-wlm and
# munge), started in a temp directory on loopback and stopped at the end, runs
# `srun -n 2` of the C trainer and the Python trainer; each rank's RESULT
# must equal sfsync-run's (world=2). Exit 77 (ctest: skipped) with the reason
# when the daemons cannot start here (not root, a binary missing, a daemon
# that does not come up).
#   slurm_test.sh SFSYNC_RUN C_TRAINER PYTHON PY_TRAINER PYTHONPATH LIBRARY
set -uo pipefail
run=$1 ctrainer=$2 python=$3 pytrainer=$4
export PYTHONPATH=$5 SFSYNC_LIBRARY=$6 PYTHONDONTWRITEBYTECODE=1 SF_TIMEOUT_MS=30000
unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT SF_RENDEZVOUS SF_RANK SF_WORLD_SIZE
skip() { echo "SKIPPED: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "the test daemons run as root (SlurmUser=root); not root here"
for b in munged slurmctld slurmd srun mungekey; do
  command -v "$b" >/dev/null || skip "$b not found (apt-get install slurm-wlm munge: scripts/install-deps.sh)"
done

dir=$(mktemp -d /tmp/sfsync-slurm-XXXXXX)
pids=()
# Stops the daemons in reverse order (munged last: slurmstepd still needs it
# to report its step), each with SIGTERM, then SIGKILL after 5 s.
stop() {
  kill "$1" 2>/dev/null || return 0
  for _ in $(seq 50); do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$1" 2>/dev/null
  wait "$1" 2>/dev/null
}
cleanup() {
  # Let the last step finish reporting before the daemons go (bounded: 10 s).
  for _ in $(seq 100); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.1; done
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do stop "${pids[i]}"; done
  [ -n "${SF_KEEP_SLURM_DIR:-}" ] || rm -rf "$dir"
}
trap cleanup EXIT
free_port() { "$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
mkdir -p "$dir/munge" "$dir/state" "$dir/spool" && chmod 700 "$dir/munge"
mungekey --create --keyfile="$dir/munge/munge.key" >/dev/null 2>&1 ||
  dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$dir/munge/munge.key"
socket=$dir/munge/munge.socket
munged -F -f --socket="$socket" --key-file="$dir/munge/munge.key" --pid-file="$dir/munge/munged.pid" \
  --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/seed" >"$dir/munged.out" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -S "$socket" ] && break; sleep 0.05; done
[ -S "$socket" ] || skip "munged did not start: $(tail -3 "$dir/munged.out" "$dir/munge/munged.log" 2>/dev/null)"

host=$(hostname -s)
# The node as slurmd sees it (CPUs, sockets, memory): a node that reports
# fewer CPUs than configured is refused at registration.
node=$(slurmd -C 2>/dev/null | head -1 | sed -E 's/ UpTime=.*//')
[ -n "$node" ] || node="NodeName=$host CPUs=1"
cat >"$dir/slurm.conf" <<CONF
ClusterName=sfsynctest
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
AuthType=auth/munge
AuthInfo=socket=$socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=test Nodes=$host Default=YES MaxTime=10 State=UP OverSubscribe=YES
CONF
export SLURM_CONF=$dir/slurm.conf
slurmctld -D -i -f "$SLURM_CONF" >"$dir/slurmctld.out" 2>&1 &
pids+=($!)
slurmd -D -f "$SLURM_CONF" -N "$host" >"$dir/slurmd.out" 2>&1 &
pids+=($!)
up=0
for _ in $(seq 100); do
  if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed)'; then up=1; break; fi
  sleep 0.1
done
[ $up = 1 ] || skip "slurmctld/slurmd did not come up: $(tail -3 "$dir"/slurmctld.log "$dir"/slurmd.log "$dir"/*.out 2>/dev/null)"

fail=0
check() {  # name, srun output, sfsync-run output
  for r in 0 1; do
    got=$(grep -o "RESULT rank=$r .*" <<<"$2" | head -1)
    want=$(grep -o "RESULT rank=$r .*" <<<"$3" | head -1)
    if [ -z "$got" ] || [ "$got" != "$want" ] || ! grep -q " world=2 .* OK" <<<"$got"; then
      echo "FAIL $1 rank $r: srun gave '$got', sfsync-run '$want'"; fail=1
    else
      echo "ok   $1 rank $r: $got"
    fi
  done
}
for t in c py; do
  if [ $t = c ]; then cmd=("$ctrainer" --windows 3 --micro 3 --quiet); else cmd=("$python" "$pytrainer"); fi
  got=$(timeout 90 srun -n 2 -N 1 --overcommit --export=ALL "${cmd[@]}" 2>&1); rc=$?
  [ $rc = 0 ] || { echo "FAIL srun -n 2 ($t) exited $rc:"; echo "$got"; fail=1; continue; }
  want=$("$run" -n 2 -- "${cmd[@]}" 2>&1)
  check "srun -n 2 $t trainer" "$got" "$want"
done
disc=$(timeout 60 srun -n 2 -N 1 --overcommit "$(dirname "$run")/sfsync-run" --discover 2>&1)
echo "$disc"
for r in 0 1; do
  grep -q "launcher=slurm rank=$r world=2 local_rank=$r rendezvous=tcp://$host:2" <<<"$disc" ||
    { echo "FAIL sfsync-run --discover under srun: rank $r"; fail=1; }
done
exit $fail
