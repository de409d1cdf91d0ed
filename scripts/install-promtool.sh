#!/usr/bin/env bash
# Test prerequisite: promtool (checks and unit-tests monitoring/ alert rules). Debian's `prometheus`
# package ships it; the server it also installs is kept from starting (policy-rc.d, no enable).
set -euo pipefail
if command -v promtool >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "install-promtool: needs root (apt-get install prometheus)" >&2
    exit 1
fi
policy=/usr/sbin/policy-rc.d
created=""
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && created=1
fi
trap '[ -n "$created" ] && rm -f "$policy"' EXIT
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v promtool
