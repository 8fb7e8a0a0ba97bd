#!/usr/bin/env bash
# A fault-tolerant job on this machine: a torchft Lighthouse and N replica groups, each a torchrun job of one
# process that torchrun restarts if it dies (hsync.fault_tolerance). Each group's lines are prefixed with its
# name (torchft's own log, its checkpoint server's and c10d's stack frames left out); the script ends when every
# group has, and returns the first failure's status.
#
#   scripts/fault_tolerant_local.sh [--min-replicas M] N PROGRAM [ARGS...]
#   scripts/fault_tolerant_local.sh 3 examples/fault_tolerant.py --device cpu --crash group1:40
#
# --min-replicas: the fewest groups a step runs on; default a majority (N/2 + 1), so that groups that start apart
# never make two jobs of one (torchft's Lighthouse issues a quorum to a minority only when no other group is
# known, as at a start); with N, a lost group's step waits for torchrun to bring it back, and is then run again
# by all.
#
# The program runs once alone first, with HSYNC_CHECK_ONLY=1: it parses its flags, and hsync.fault_tolerance ends
# it before it joins a job; a refused flag ends the script there, in one line.
#
# On several machines, start one Lighthouse (torchft_lighthouse --min_replicas M) and on each machine its groups
# as below, with TORCHFT_LIGHTHOUSE=http://LIGHTHOUSE_HOST:PORT and a REPLICA_GROUP_ID unique in the job.
set -euo pipefail
cd "$(dirname "$0")/.."

usage="usage: scripts/fault_tolerant_local.sh [--min-replicas M] N PROGRAM [ARGS...]"
min_replicas=
if [ "${1:-}" = "--min-replicas" ]; then
  min_replicas=${2:-}
  shift 2 || true
fi
if [ $# -lt 2 ]; then
  echo "fault_tolerant_local.sh: $usage" >&2
  exit 2
fi
groups=$1
shift
# At most three digits: bash's arithmetic wraps a longer number around, and one machine runs a few groups.
if ! [[ "$groups" =~ ^[1-9][0-9]{0,2}$ ]]; then
  echo "fault_tolerant_local.sh: N must be a number of replica groups from 1 to 999, got '$groups' ($usage)" >&2
  exit 2
fi
min_replicas=${min_replicas:-$((groups / 2 + 1))}
if ! [[ "$min_replicas" =~ ^[1-9][0-9]{0,2}$ ]] || ((min_replicas > groups)); then
  echo "fault_tolerant_local.sh: --min-replicas must be a number from 1 to N ($groups), got '$min_replicas'" >&2
  exit 2
fi
if [ ! -f "$1" ]; then
  echo "fault_tolerant_local.sh: no program '$1' ($usage)" >&2
  exit 2
fi
bin=.venv/bin
port=$("$bin/python" -c "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])")
export TORCHFT_LIGHTHOUSE=http://localhost:$port

# Under torchrun, a refused flag would be printed by every group, again at each restart.
REPLICA_GROUP_ID=group0 HSYNC_CHECK_ONLY=1 "$bin/python" "$@"

# A dead group is seen at its next collective; its heartbeat stops counting after 2 s, and a quorum waits up to
# 2 s for groups that heartbeat but have not asked to join.
"$bin/torchft_lighthouse" --min_replicas "$min_replicas" --bind "[::]:$port" --join_timeout_ms 2000 \
  --heartbeat_timeout_ms 2000 --quorum_tick_ms 50 > /dev/null 2>&1 &
lighthouse=$!
trap 'kill $lighthouse 2> /dev/null || true' EXIT

pids=()
for ((g = 0; g < groups; g++)); do
  (
    set +e  # the status is torchrun's, not its filter's
    export REPLICA_GROUP_ID=group$g
    "$bin/torchrun" --standalone --nproc_per_node 1 --max-restarts 3 "$@" 2>&1 \
      | grep --line-buffered -v -e '\[INFO\]' -e '"GET /checkpoint/' -e '^frame #' -e '^Exception raised from' \
      | sed -u "s/^/[group$g] /"
    exit "${PIPESTATUS[0]}"
  ) &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || { code=$?; [ "$status" -ne 0 ] || status=$code; }
done
exit "$status"
