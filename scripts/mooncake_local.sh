#!/usr/bin/env bash
# Run a command next to a loopback-only Mooncake store (master + one client).
#
#   scripts/mooncake_local.sh [--segment BYTES] [--] [COMMAND ARGS...]
#
# Creates a private network namespace (unshare -n; root needed), brings lo up, starts
# mooncake_master and mooncake_client bound to 127.0.0.1 inside it, waits (bounded)
# until the master logs the client's segment mount, runs COMMAND (default: an
# interactive shell) in the same namespace with MOONCAKE_MASTER=127.0.0.1:50051
# exported, then stops both services by PID. Nothing is reachable from outside the
# namespace: some Mooncake listeners bind 0.0.0.0 whatever their flags say.
#
# Example: scripts/mooncake_local.sh -- .venv/bin/python scripts/bench_mooncake.py
set -euo pipefail

segment=$((256 << 20))
if [ "${1:-}" = "--segment" ]; then
  segment=$2
  shift 2
fi
[ "${1:-}" = "--" ] && shift

if [ -z "${MOONCAKE_LOCAL_INSIDE:-}" ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "mooncake_local.sh: needs root for a private network namespace (unshare -n)" >&2
    exit 2
  fi
  export MOONCAKE_LOCAL_INSIDE=1
  exec unshare -n -- "$0" --segment "$segment" -- "$@"
fi

here=$(cd "$(dirname "$0")/.." && pwd)
bin_dir=$here/.venv/bin
find_bin() {
  if [ -x "$bin_dir/$1" ]; then echo "$bin_dir/$1"; else command -v "$1"; fi
}
master_bin=$(find_bin mooncake_master) || { echo "mooncake_master not found" >&2; exit 2; }
client_bin=$(find_bin mooncake_client) || { echo "mooncake_client not found" >&2; exit 2; }

if command -v ip >/dev/null; then
  ip link set lo up
else
  py=python3
  [ -x "$bin_dir/python" ] && py=$bin_dir/python
  "$py" -c 'import fcntl, socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
f = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH", b"lo", 0))[:18])[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", f | 1))'
fi

logs=$(mktemp -d /tmp/mooncake-local-XXXXXX)
master_pid=""
client_pid=""
stop() {
  for pid in $client_pid $master_pid; do
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
}
trap stop EXIT

"$master_bin" --rpc_address=127.0.0.1 --rpc_port=50051 --metrics_host=127.0.0.1 \
  --enable_metric_reporting=false --logtostderr >"$logs/master.log" 2>&1 &
master_pid=$!
"$client_bin" --host=127.0.0.1 --port=50052 --master_server_address=127.0.0.1:50051 \
  --metadata_server=P2PHANDSHAKE --global_segment_size="$segment" --protocol=tcp \
  --logtostderr >"$logs/client.log" 2>&1 &
client_pid=$!

for _ in $(seq 300); do
  grep -q "action=mount_segment" "$logs/master.log" 2>/dev/null && break
  for pid in $master_pid $client_pid; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "mooncake_local.sh: a service exited early; logs in $logs" >&2
      exit 1
    fi
  done
  sleep 0.1
done
if ! grep -q "action=mount_segment" "$logs/master.log"; then
  echo "mooncake_local.sh: client segment not mounted within 30 s; logs in $logs" >&2
  exit 1
fi
echo "mooncake_local.sh: master 127.0.0.1:50051, $segment-byte segment; logs in $logs" >&2

export MOONCAKE_MASTER=127.0.0.1:50051
unset MOONCAKE_LOCAL_INSIDE
status=0
if [ $# -eq 0 ]; then "${SHELL:-bash}" || status=$?; else "$@" || status=$?; fi
exit $status
