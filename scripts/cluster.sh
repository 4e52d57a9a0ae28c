#!/usr/bin/env bash
# A simulated cluster on one machine: N hosts as network namespaces, one NIC
# (veth "eth0", 10.77.0.(i+1)/24) each, joined by a bridge in a namespace of
# its own, every NIC limited to RATE in both directions with tc tbf. Nothing
# is added to the root namespace (the 10.x addresses exist only inside the
# namespaces this script creates), so parallel clusters do not collide: each
# has its own id and namespaces named sfc-<id>-*.
#
#   scripts/cluster.sh run N RATE [--] CMD ARGS...   up, one CMD per host, down
#   id=$(scripts/cluster.sh up N RATE)                  prints the cluster id
#   scripts/cluster.sh exec ID HOST CMD ARGS...         CMD in host HOST (0-based)
#   scripts/cluster.sh rate ID HOST RATE                change one host's NIC rate
#   scripts/cluster.sh cut ID HOST | heal ID HOST       take a host's NIC down / up
#   scripts/cluster.sh stats ID HOST                    "tx_bytes rx_bytes" of its NIC
#   scripts/cluster.sh down ID                          remove everything of ID
#   scripts/cluster.sh check                            exit 0 if clusters can run here
#
# RATE is tc's syntax (200mbit, 1gbit, 10gbit) or "none" for no limit.
# In every host, commands get SF_GLOO_HOSTNAME (the host's address),
# GLOO_SOCKET_IFNAME=eth0, SF_CLUSTER_HOST (index) and SF_CLUSTER_ADDR0 (host
# 0's address). "run" adds the torchrun variables: RANK = host index,
# WORLD_SIZE = N, LOCAL_RANK = 0, MASTER_ADDR = host 0, MASTER_PORT (29400
# unless set), prefixes each host's output with "[hI] ", and returns the first
# non-zero status (the other hosts then get SIGTERM, SIGKILL 5 s later).
# "run" removes the cluster on every exit path (also on SIGINT/SIGTERM).
#
# Exit status 77 (and a line starting "cluster.sh: SKIP:") when this machine
# cannot run a cluster: not root, no `ip netns`, no veth/bridge, no tbf.
# Needs: iproute2 (ip, tc), root.
set -u

readonly kSkip=77
readonly kSubnet=10.77.0
readonly kStateRoot=${SF_CLUSTER_STATE:-/run/sfsync-cluster}

die() { echo "cluster.sh: $*" >&2; exit 1; }
skip() { echo "cluster.sh: SKIP: $*" >&2; exit $kSkip; }

ns_host() { echo "sfc-$1-h$2"; }
ns_bridge() { echo "sfc-$1-br"; }
addr() { echo "$kSubnet.$(($1 + 1))"; }

# tbf wants a bucket of at least one timer tick's worth of bytes: 2 ms of
# the rate, not under 64 KiB; the queue may hold 50 ms.
tbf_args() {
  local rate=$1 bits
  bits=$(rate_bits "$rate") || die "bad RATE '$rate' (use e.g. 200mbit, 1gbit, 10gbit, none)"
  local burst=$((bits / 8 / 500))
  ((burst < 65536)) && burst=65536
  echo "rate $rate burst $burst latency 50ms"
}

rate_bits() {
  local r=${1,,}
  case $r in
    *gbit) echo $((${r%gbit} * 1000000000)) ;;
    *mbit) echo $((${r%mbit} * 1000000)) ;;
    *kbit) echo $((${r%kbit} * 1000)) ;;
    *) return 1 ;;
  esac
}

# Exit 77 with the reason unless namespaces, veth, bridge and tbf work.
check() {
  [[ $(id -u) == 0 ]] || skip "needs root (uid $(id -u)) for network namespaces"
  command -v ip > /dev/null || skip "no 'ip' (iproute2)"
  command -v tc > /dev/null || skip "no 'tc' (iproute2)"
  local probe="sfc-probe$$"
  ip netns add "$probe" 2> /dev/null || skip "'ip netns add' does not work here"
  local why=""
  if ! ip -n "$probe" link add v0 type veth peer name v1 2> /dev/null; then
    why="no veth devices"
  elif ! ip -n "$probe" link add b0 type bridge 2> /dev/null; then
    why="no bridge devices"
  elif ! ip -n "$probe" link set v0 up 2> /dev/null ||
    ! tc -n "$probe" qdisc add dev v0 root tbf rate 1gbit burst 256kb latency 50ms 2> /dev/null; then
    why="no tc tbf qdisc"
  fi
  ip netns del "$probe" 2> /dev/null
  [[ -z $why ]] || skip "$why"
}

new_id() {
  # Short (interface and namespace names), unique per run.
  printf 'c%x%04x' "$$" "$((RANDOM))"
}

# up N RATE: prints the id. On failure removes what it made.
up() {
  local n=${1:-} rate=${2:-}
  [[ $n =~ ^[0-9]+$ ]] && ((n >= 1 && n <= 200)) || die "up: N must be 1..200, got '$n'"
  [[ -n $rate ]] || die "up: RATE missing (e.g. 1gbit, or none)"
  [[ $rate == none ]] || rate_bits "$rate" > /dev/null ||
    die "up: bad RATE '$rate' (use e.g. 200mbit, 1gbit, 10gbit, none)"
  check
  local id
  id=$(new_id)
  mkdir -p "$kStateRoot" || die "cannot create $kStateRoot"
  if ! up_inner "$id" "$n" "$rate"; then
    down "$id" 2> /dev/null
    die "up: could not build cluster $id"
  fi
  printf '%s\n%s\n' "$n" "$rate" > "$kStateRoot/$id"
  echo "$id"
}

up_inner() {
  local id=$1 n=$2 rate=$3 br i h tbf=""
  br=$(ns_bridge "$id")
  [[ $rate == none ]] || tbf=$(tbf_args "$rate")
  ip netns add "$br" || return 1
  ip -n "$br" link add br0 type bridge || return 1
  ip -n "$br" link set br0 up || return 1
  for ((i = 0; i < n; i++)); do
    h=$(ns_host "$id" "$i")
    ip netns add "$h" || return 1
    ip -n "$h" link set lo up || return 1
    ip link add eth0 netns "$h" type veth peer name "p$i" netns "$br" || return 1
    ip -n "$h" addr add "$(addr "$i")/24" dev eth0 || return 1
    ip -n "$h" link set eth0 up || return 1
    ip -n "$br" link set "p$i" master br0 || return 1
    ip -n "$br" link set "p$i" up || return 1
    if [[ -n $tbf ]]; then
      # Host egress (its upload) and the bridge port's egress (its download).
      tc -n "$h" qdisc add dev eth0 root tbf $tbf || return 1
      tc -n "$br" qdisc add dev "p$i" root tbf $tbf || return 1
    fi
  done
}

# down ID: kills what still runs in its hosts, removes the namespaces.
down() {
  local id=${1:-} ns pids
  [[ $id =~ ^c[0-9a-f]+$ ]] || die "down: bad cluster id '$id'"
  for ns in $(ip netns list 2> /dev/null | awk '{print $1}' | grep "^sfc-$id-"); do
    pids=$(ip netns pids "$ns" 2> /dev/null)
    [[ -n $pids ]] && kill -KILL $pids 2> /dev/null
    ip netns del "$ns" 2> /dev/null
  done
  rm -f "$kStateRoot/$id"
  ! ip netns list 2> /dev/null | grep -q "^sfc-$id-"
}

hosts_of() {
  [[ -f $kStateRoot/$1 ]] || die "no cluster '$1' (see 'up')"
  head -1 "$kStateRoot/$1"
}

host_ns() {
  local id=$1 host=$2 n
  n=$(hosts_of "$id")
  [[ $host =~ ^[0-9]+$ ]] && ((host < n)) || die "host must be 0..$((n - 1)), got '$host'"
  ns_host "$id" "$host"
}

# exec ID HOST CMD...: CMD in the host, with its address in the environment.
exec_in() {
  local id=${1:-} host=${2:-} ns
  shift 2 || die "exec: need ID HOST CMD"
  (($# > 0)) || die "exec: need a command"
  ns=$(host_ns "$id" "$host") || exit 1
  exec ip netns exec "$ns" env SF_GLOO_HOSTNAME="$(addr "$host")" GLOO_SOCKET_IFNAME=eth0 \
    SF_CLUSTER_HOST="$host" SF_CLUSTER_ADDR0="$(addr 0)" SF_CLUSTER_ID="$id" "$@"
}

set_rate() {
  local id=$1 host=$2 rate=$3 ns br
  ns=$(host_ns "$id" "$host") || exit 1
  br=$(ns_bridge "$id")
  tc -n "$ns" qdisc del dev eth0 root 2> /dev/null
  tc -n "$br" qdisc del dev "p$host" root 2> /dev/null
  [[ $rate == none ]] && return 0
  local tbf
  tbf=$(tbf_args "$rate") || exit 1
  tc -n "$ns" qdisc add dev eth0 root tbf $tbf && tc -n "$br" qdisc add dev "p$host" root tbf $tbf
}

# run N RATE [--] CMD...: a whole job, cleaned up on every exit path.
run() {
  local n=${1:-} rate=${2:-}
  shift 2 || die "run: need N RATE CMD"
  [[ ${1:-} == -- ]] && shift
  (($# > 0)) || die "run: need a command"
  local id
  id=$(up "$n" "$rate") || exit $?
  RUN_ID=$id
  RUN_PIDS=()
  trap 'run_cleanup' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  local port=${MASTER_PORT:-29400} i
  echo "cluster.sh: cluster $id: $n hosts at $rate" >&2
  for ((i = 0; i < n; i++)); do
    (
      # Children see the signals; the prefix filter must not outlive them.
      trap - EXIT INT TERM
      RANK=$i WORLD_SIZE=$n LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 GROUP_RANK=$i \
        MASTER_ADDR=$(addr 0) MASTER_PORT=$port \
        "$0" exec "$id" "$i" "$@" > >(sed -u "s/^/[h$i] /") 2> >(sed -u "s/^/[h$i] /" >&2)
    ) &
    RUN_PIDS+=($!)
  done
  local status=0 rc done_pid
  local -a left=("${RUN_PIDS[@]}")
  while ((${#left[@]} > 0)); do
    done_pid=""
    wait -n -p done_pid "${left[@]}"
    rc=$?
    [[ -n $done_pid ]] || break
    local -a rest=()
    local p
    for p in "${left[@]}"; do [[ $p == "$done_pid" ]] || rest+=("$p"); done
    left=("${rest[@]}")
    if ((rc != 0 && status == 0)); then
      status=$rc
      echo "cluster.sh: a host exited with status $rc; stopping the others" >&2
      stop_hosts
    fi
  done
  exit $status
}

stop_hosts() {
  local ns pids
  for ns in $(ip netns list 2> /dev/null | awk '{print $1}' | grep "^sfc-$RUN_ID-h"); do
    pids=$(ip netns pids "$ns" 2> /dev/null)
    [[ -n $pids ]] && kill -TERM $pids 2> /dev/null
  done
  (
    sleep 5
    for ns in $(ip netns list 2> /dev/null | awk '{print $1}' | grep "^sfc-$RUN_ID-h"); do
      pids=$(ip netns pids "$ns" 2> /dev/null)
      [[ -n $pids ]] && kill -KILL $pids 2> /dev/null
    done
  ) < /dev/null > /dev/null 2>&1 &
}

run_cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  [[ -n ${RUN_ID:-} ]] && down "$RUN_ID"
  exit $rc
}

cmd=${1:-}
shift || true
case $cmd in
  check) check ;;
  up) up "$@" ;;
  down) down "$@" ;;
  exec) exec_in "$@" ;;
  run) run "$@" ;;
  rate) set_rate "$@" ;;
  cut) ns=$(host_ns "${1:-}" "${2:-}") || exit 1; ip -n "$ns" link set eth0 down ;;
  heal) ns=$(host_ns "${1:-}" "${2:-}") || exit 1; ip -n "$ns" link set eth0 up ;;
  stats)
    ns=$(host_ns "${1:-}" "${2:-}") || exit 1
    ip netns exec "$ns" sh -c 'echo $(cat /sys/class/net/eth0/statistics/tx_bytes) $(cat /sys/class/net/eth0/statistics/rx_bytes)'
    ;;
  *)
    sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
