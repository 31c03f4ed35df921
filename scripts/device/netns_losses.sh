#!/usr/bin/env bash
# Watch the emulated cluster's losses while a bench runs: every 0.5 s, for each namespace the
# benches build (bpsl-*), the packets its tbf queues dropped and its TCP retransmission
# timeouts. The namespaces go when the bench ends, so the last sample of each is kept and
# printed when the watcher is stopped (SIGTERM/SIGINT) or the command it runs ends.
#
#   bash scripts/device/netns_losses.sh -- python3 -m byteps_like.bench sparse ...
#
# A TCP timeout (RTO, at least 200 ms on Linux) after a tail drop in a tbf queue stalls a
# stream for that long: the watcher says whether a stall a bench saw lines up with one.
set -uo pipefail
[ "${1:-}" = "--" ] && shift
dir=$(mktemp -d)

sample() {  # sample NS: one line "drops timeouts retrans" into $dir/NS
  local ns=$1 drops timeouts retrans
  drops=$(tc -s -n "$ns" qdisc show 2>/dev/null |
    awk '/dropped/ {for (i = 1; i <= NF; i++) if ($i == "(dropped") {gsub(",", "", $(i+1)); s += $(i+1)}} END {print s + 0}')
  timeouts=$(ip netns exec "$ns" awk '/^TcpExt:/ {if (!h) {for (i = 1; i <= NF; i++) k[i] = $i; h = 1}
    else for (i = 1; i <= NF; i++) if (k[i] == "TCPTimeouts") print $i}' /proc/net/netstat 2>/dev/null)
  retrans=$(ip netns exec "$ns" awk '/^Tcp:/ {if (!h) {for (i = 1; i <= NF; i++) k[i] = $i; h = 1}
    else for (i = 1; i <= NF; i++) if (k[i] == "RetransSegs") print $i}' /proc/net/snmp 2>/dev/null)
  [ -n "$timeouts" ] && echo "$drops ${timeouts:-0} ${retrans:-0}" > "$dir/$ns"
}

report() {
  printf '%-28s %10s %12s %12s\n' namespace tbf_drops tcp_timeouts retrans_segs
  for f in "$dir"/*; do
    [ -e "$f" ] || { echo "(no bpsl-* namespace was seen)"; break; }
    read -r d t r < "$f"
    printf '%-28s %10s %12s %12s\n' "$(basename "$f")" "$d" "$t" "$r"
  done
  rm -rf "$dir"
}

"$@" &
child=$!
trap 'kill "$child" 2>/dev/null' INT TERM
while kill -0 "$child" 2>/dev/null; do
  for ns in $(ip netns list 2>/dev/null | awk '/^bpsl-/ {print $1}'); do sample "$ns"; done
  sleep 0.5
done
wait "$child"
rc=$?
report
exit "$rc"
