#!/usr/bin/env bash
# Installs what the lab hosts need on the controller (Debian): systemd-nspawn, debootstrap, iproute2, an ssh
# client. Idempotent and quiet when everything is already there; apt-get update runs at most once per call.
# Run as root (CI is root). Several checkouts may call this at the same time: apt is serialised with a lock.
set -euo pipefail

need=()
command -v systemd-nspawn >/dev/null || need+=(systemd-container)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v ip >/dev/null || need+=(iproute2)
command -v ssh >/dev/null || need+=(openssh-client)
command -v ssh-keygen >/dev/null || need+=(openssh-client)
[ -e /usr/share/keyrings/debian-archive-keyring.gpg ] || need+=(debian-archive-keyring)
command -v flock >/dev/null || need+=(util-linux)

if [ "${#need[@]}" -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "lab prerequisites missing (${need[*]}): run scripts/lab/prereqs.sh as root" >&2
    exit 1
fi
echo "lab prereqs: installing ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
# flock: apt's own lock fails fast instead of waiting; another checkout may be installing right now.
exec 9>/tmp/ddtree-lab-apt.lock
flock 9
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
echo "lab prereqs: done" >&2
