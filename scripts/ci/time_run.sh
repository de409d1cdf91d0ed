#!/usr/bin/env bash
# Times one run of a command (default: .ci/run in the current checkout) and prints one JSON line:
# wall seconds, the CPU seconds of everything it started (lab machines included: they stay in the
# caller's cgroup, nspawn runs with --keep-unit) and the machine's load before and after, since
# wall time on a shared 2-core machine means little without it (docs/ci-time.md).
# Usage: bash scripts/ci/time_run.sh [LOG] [-- COMMAND...]
set -uo pipefail
log=${1:-/dev/null}
shift || true
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || set -- bash .ci/run
acct=""
if [ -w /sys/fs/cgroup/cpuacct ]; then  # cgroup v1 cpuacct: a group of our own for the run
    acct=/sys/fs/cgroup/cpuacct/ddtree-ci-time-$$
    mkdir -p "$acct" && echo $$ > "$acct/cgroup.procs"
elif [ -f /sys/fs/cgroup/cgroup.controllers ] && [ -w /sys/fs/cgroup ]; then  # cgroup v2
    acct=/sys/fs/cgroup/ddtree-ci-time-$$
    mkdir -p "$acct" && echo $$ > "$acct/cgroup.procs"
fi
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
start=$(date +%s.%N)
"$@" >"$log" 2>&1
rc=$?
end=$(date +%s.%N)
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
cpu=null
if [ -n "$acct" ] && [ -f "$acct/cpuacct.usage" ]; then
    cpu=$(awk '{printf "%.0f", $1 / 1e9}' "$acct/cpuacct.usage")
elif [ -n "$acct" ] && [ -f "$acct/cpu.stat" ]; then
    cpu=$(awk '$1 == "usage_usec" {printf "%.0f", $2 / 1e6}' "$acct/cpu.stat")
fi
printf '{"command": "%s", "rc": %d, "wall_s": %.0f, "cpu_s": %s, "load_before": "%s", "load_after": "%s", "log": "%s"}\n' \
    "$*" "$rc" "$(echo "$end - $start" | bc)" "$cpu" "$load_before" "$load_after" "$log"
if [ -n "$acct" ]; then  # back to the parent group; the group goes once nothing is left in it
    echo $$ > "$(dirname "$acct")/cgroup.procs" 2>/dev/null && rmdir "$acct" 2>/dev/null
fi
exit $rc
