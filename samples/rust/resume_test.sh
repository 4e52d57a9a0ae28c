#!/bin/sh
# Save and resume of the Rust sample's sharded run, as three pairs of
# processes: an uninterrupted run of W windows (its final weights written per
# rank), a run stopped after window K that writes one checkpoint per rank,
# and new processes that load those files, call sf_restore_windows and finish.
# The resumed weights must equal the uninterrupted ones bitwise (the trainer
# compares them, --expect-weights, and so does cmp here); the checkpoints are
# left in WORKDIR for the tests that resume them wrongly.
# Usage: resume_test.sh SFSYNC_RUN TRAINER WORKDIR LAYOUT WINDOWS K
set -eu
run=$1 trainer=$2 dir=$3 layout=$4 windows=$5 k=$6
rm -rf "$dir"
mkdir -p "$dir"
common="--shard $layout --lr 0.01 --windows $windows"
echo "== uninterrupted: $windows windows"
"$run" -n 2 -- "$trainer" $common --weights-out "$dir/full"
echo "== stopped after window $((k - 1)), a checkpoint per rank"
"$run" -n 2 -- "$trainer" $common --stop-after "$k" --checkpoint "$dir/ckpt"
echo "== resumed in new processes"
"$run" -n 2 -- "$trainer" $common --resume "$dir/ckpt" --weights-out "$dir/resumed" \
  --expect-weights "$dir/full"
for r in 0 1; do
  cmp "$dir/full.rank$r.weights" "$dir/resumed.rank$r.weights"
done
echo "RESUME OK: $layout, stopped after $k of $windows windows, resumed weights bitwise equal on both ranks"
