#!/usr/bin/env bash
# The real-process suites on simulated hosts (scripts/cluster.sh, each rank
# in its own network namespace) for every rendezvous that crosses hosts:
# env:// (store on host 0), redis:// (a real redis-server on a host of its
# own) and file:// (a shared directory). Per store:
#   1. three ranks on three hosts complete with weights equal to the
#      single-process reference;
#   2. a host's link goes down mid-run (ip link set eth0 down): every rank
#      ends with SF_ERR_TIMEOUT or SF_ERR_BACKEND, its failing call lasting at
#      most timeout_ms + slack, and its process exiting at most
#      2 x timeout_ms + slack after the cut (the failing wait, then teardown
#      waiting for what is in flight).
# Ranks are sfsync-chaos-rank (tests/chaos): it checks weights and reports
# the failing call, its status and duration in one "CHAOS" line.
#   rendezvous_hosts.sh CLUSTER_SH CHAOS_RANK [STORES...]   (default: env redis file)
# Exit 77 (ctest SKIP) where clusters cannot run (not root, no netns).
set -u
CLUSTER=$1 RANKPROG=$2
shift 2
stores=("$@")
((${#stores[@]})) || stores=(env redis file)
TIMEOUT_MS=${SF_MULTIHOST_TIMEOUT_MS:-3000}
SLACK_MS=${SF_MULTIHOST_SLACK_MS:-3000}
WORLD=3
# A rank still running this long is hung (killed, and reported so).
RANK_LIMIT_S=$(((4 * TIMEOUT_MS + SLACK_MS) / 1000 + 15))
fails=0
ok() { echo "ok: $*"; }
bad() { echo "FAIL: $*"; fails=$((fails + 1)); }
now_ms() { date +%s%3N; }

"$CLUSTER" check || exit $?
work=$(mktemp -d /tmp/sfsync-multihost-XXXXXX)
id=""
redis_pid=""
cleanup() {
  [[ -n $redis_pid ]] && kill "$redis_pid" 2> /dev/null
  [[ -n $id ]] && "$CLUSTER" down "$id" 2> /dev/null
  rm -rf "$work"
}
trap cleanup EXIT

micro() { local n=$1 m=$2 s="" i; for ((i = 0; i < n; i++)); do s+="${s:+:}$m"; done; echo "$s"; }
plan() {  # plan WINDOWS MICRO ROWS IN
  echo "seed=1,world=$WORLD,micro=$(micro "$1" "$2"),blocks=8,rows=$3,in=$4,batch=4,cap=0.03125,first=0.0078125,flat=1,ready=1,op=0,timeout=$TIMEOUT_MS,fault=0,point=0,target=0,at=0,delay=0,call=0,layout=0"
}

# start STORE TAG PLAN: ranks 0..WORLD-1 on hosts 0..WORLD-1 (one MASTER_PORT
# for all), outputs in $work/TAG.rankR.
# Waits for ranks 0..N-1 of run TAG (started at t0) and sets worst_exit (ms
# after t0 of the last exit), statuses ("rank:status/failing-call-ms ...")
# and all_failed (1 if every rank failed with SF_ERR_TIMEOUT or SF_ERR_BACKEND).
await_failures() {
  local tag=$1 n=$2 r t_exit f st err
  worst_exit=0 statuses="" all_failed=1
  for ((r = 0; r < n; r++)); do
    wait "${pids[r]}"
    t_exit=$(($(now_ms) - t0))
    ((t_exit > worst_exit)) && worst_exit=$t_exit
    f=$work/$tag.rank$r
    st=$(field "$f" status) err=$(field "$f" errms)
    statuses+="$r:${st:-none}/${err%.*}ms "
    if [[ $st != 4 && $st != 5 ]]; then
      all_failed=0
      [[ -z $st ]] && echo "    rank $r: no result (hung: killed after ${RANK_LIMIT_S} s)"
    fi
  done
}

start() {
  local store=$1 tag=$2 p=$3 r rdv port=$((29500 + RANDOM % 1000))
  case $store in
    env) rdv="env://" ;;
    redis) rdv="redis://10.77.0.$((WORLD + 1)):6379/$tag" ;;
    file) rdv="file://$work/$tag-store" ;;
  esac
  pids=()
  for ((r = 0; r < ${WORLD_STARTED:-$WORLD}; r++)); do
    RANK=$r WORLD_SIZE=$WORLD LOCAL_RANK=0 MASTER_ADDR=10.77.0.1 MASTER_PORT=$port \
      SF_RENDEZVOUS=$rdv timeout -s KILL "$RANK_LIMIT_S" "$CLUSTER" exec "$id" "$r" "$RANKPROG" "$p" \
      > "$work/$tag.rank$r" 2>&1 &
    pids[r]=$!
  done
}

field() { sed -n "s/^CHAOS .* $2=\([^ ]*\).*/\1/p" "$1" | head -1; }

for store in "${stores[@]}"; do
  hosts=$WORLD
  [[ $store == redis ]] && hosts=$((WORLD + 1))
  if [[ $store == redis ]] && ! command -v redis-server > /dev/null; then
    echo "SKIP: redis:// (no redis-server)"
    continue
  fi
  id=$("$CLUSTER" up "$hosts" 100mbit) || { bad "$store: cluster up"; continue; }
  if [[ $store == redis ]]; then
    "$CLUSTER" exec "$id" "$WORLD" redis-server --port 6379 --bind 10.77.0.$((WORLD + 1)) --save "" \
      --appendonly no --protected-mode no > "$work/redis.log" 2>&1 &
    redis_pid=$!
    for _ in $(seq 100); do
      "$CLUSTER" exec "$id" 0 redis-cli -h 10.77.0.$((WORLD + 1)) ping 2> /dev/null | grep -q PONG && break
      sleep 0.05
    done
  fi

  # 1. A whole job across hosts.
  start "$store" "$store-ok" "$(plan 4 3 16 64)"
  rcs=""
  for ((r = 0; r < WORLD; r++)); do wait "${pids[r]}"; rcs+="$? "; done
  good=0
  for ((r = 0; r < WORLD; r++)); do
    f=$work/$store-ok.rank$r
    if [[ $(field "$f" completed) == 1 ]] && awk -v d="$(field "$f" maxdiff)" 'BEGIN { exit !(d >= 0 && d <= 1e-5) }'; then
      good=$((good + 1))
    else
      sed 's/^/    /' "$f" | head -5
    fi
  done
  ((good == WORLD)) && ok "$store: $WORLD ranks on $WORLD hosts complete, weights equal the reference (exit $rcs)" ||
    bad "$store: $good of $WORLD ranks completed with reference weights (exit $rcs)"

  # 2. A host's link goes down mid-run: host WORLD-1, and for env:// host 0 (the store's host) too.
  victims=($((WORLD - 1)))
  [[ $store == env ]] && victims+=(0)
  for v in "${victims[@]}"; do
    for ((h = 0; h < WORLD; h++)); do "$CLUSTER" heal "$id" "$h"; done
    tag=$store-cut$v
    start "$store" "$tag" "$(plan 64 4 64 256)"
    sleep 1
    t_cut=$(now_ms)
    "$CLUSTER" cut "$id" "$v"
    worst_exit=0 worst_err=0 statuses="" all_failed=1
    for ((r = 0; r < WORLD; r++)); do
      wait "${pids[r]}"
      t_exit=$(($(now_ms) - t_cut))
      ((t_exit > worst_exit)) && worst_exit=$t_exit
      f=$work/$tag.rank$r
      st=$(field "$f" status) err=$(field "$f" errms) done=$(field "$f" completed)
      statuses+="$r:${st:-none}/${err%.*}ms "
      [[ $done == 1 ]] && all_failed=0
      if [[ $st != 4 && $st != 5 ]]; then
        all_failed=0
        [[ -z $st ]] && echo "    rank $r: no result (hung: killed after ${RANK_LIMIT_S} s)"
        sed 's/^/    /' "$f" | head -3
      fi
      [[ -n $err ]] && ((${err%.*} > worst_err)) && worst_err=${err%.*}
    done
    echo "  $store, link of host $v down: rank:status/failing-call-ms $statuses; last exit ${worst_exit} ms after the cut"
    if ((all_failed)); then
      ok "$store: host $v's link down: every rank failed with SF_ERR_TIMEOUT/SF_ERR_BACKEND"
    else
      bad "$store: host $v's link down: not every rank failed with SF_ERR_TIMEOUT/SF_ERR_BACKEND ($statuses)"
    fi
    ((worst_err <= TIMEOUT_MS + SLACK_MS)) && ok "$store: slowest failing call ${worst_err} ms <= timeout ${TIMEOUT_MS} + slack ${SLACK_MS}" ||
      bad "$store: a failing call took ${worst_err} ms > timeout ${TIMEOUT_MS} + slack ${SLACK_MS}"
    ((worst_exit <= 2 * TIMEOUT_MS + SLACK_MS)) && ok "$store: every rank exited ${worst_exit} ms after the cut <= 2 x timeout + slack" ||
      bad "$store: a rank exited ${worst_exit} ms after the cut > 2 x ${TIMEOUT_MS} + ${SLACK_MS}"
  done
  # 3. A host whose link is down from the start (env://): nobody can meet
  #    it; every rank, the cut-off one included, fails within timeout + slack.
  if [[ $store == env ]]; then
    for ((h = 0; h < WORLD; h++)); do "$CLUSTER" heal "$id" "$h"; done
    v=$((WORLD - 1))
    "$CLUSTER" cut "$id" "$v"
    tag=$store-down$v
    t0=$(now_ms)
    start "$store" "$tag" "$(plan 2 2 16 64)"
    await_failures "$tag" "$WORLD"
    echo "  $store, host $v's link down from the start: rank:status/failing-call-ms $statuses; last exit ${worst_exit} ms after start"
    ((all_failed)) && ok "$store: host $v unreachable from the start: every rank failed with SF_ERR_TIMEOUT/SF_ERR_BACKEND" ||
      bad "$store: host $v unreachable from the start: not every rank failed ($statuses)"
    ((worst_exit <= 2 * TIMEOUT_MS + SLACK_MS)) && ok "$store: every rank exited ${worst_exit} ms after start <= 2 x timeout + slack" ||
      bad "$store: a rank exited ${worst_exit} ms after start > 2 x ${TIMEOUT_MS} + ${SLACK_MS}"
  fi
  # 4. The store's host loses its link while the ranks wait in the
  #    rendezvous (the last rank never comes): no answer, no reset. Every
  #    started rank fails within timeout + slack of its start.
  if [[ $store == env || $store == redis ]]; then
    for ((h = 0; h < hosts; h++)); do "$CLUSTER" heal "$id" "$h"; done
    sh=0
    [[ $store == redis ]] && sh=$WORLD
    tag=$store-storecut
    t0=$(now_ms)
    WORLD_STARTED=$((WORLD - 1)) start "$store" "$tag" "$(plan 2 2 16 64)"
    sleep 0.7
    "$CLUSTER" cut "$id" "$sh"
    await_failures "$tag" $((WORLD - 1))
    "$CLUSTER" heal "$id" "$sh"
    echo "  $store, the store's host $sh cut during the rendezvous: rank:status/failing-call-ms $statuses; last exit ${worst_exit} ms after start"
    ((all_failed)) && ok "$store: store host cut during the rendezvous: every rank failed with SF_ERR_TIMEOUT/SF_ERR_BACKEND" ||
      bad "$store: store host cut during the rendezvous: not every rank failed ($statuses)"
    ((worst_exit <= 2 * TIMEOUT_MS + SLACK_MS)) && ok "$store: every rank exited ${worst_exit} ms after start <= 2 x timeout + slack" ||
      bad "$store: a rank exited ${worst_exit} ms after start > 2 x ${TIMEOUT_MS} + ${SLACK_MS}"
  fi
  [[ -n $redis_pid ]] && { kill "$redis_pid" 2> /dev/null; wait "$redis_pid" 2> /dev/null; redis_pid=""; }
  "$CLUSTER" down "$id"
  id=""
done

((fails == 0)) && { echo "rendezvous_hosts: all passed"; exit 0; }
echo "rendezvous_hosts: $fails failed"
exit 1
