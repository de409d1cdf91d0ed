#!/usr/bin/env bash
# README's main job (`make demo`): deploy SGLang + DDTree with the real playbook to a local lab host and
# show that it serves. Steps: lab host up (systemd-nspawn, real systemd + sshd) -> wheelhouse (what the
# host installs from) -> `ansible-playbook deploy.yml -i inventories/lab -l ct131` (release venv, lab
# models made on the host, static probe, unit, live probe) -> the probe report and a request.
# ct131 runs the real SGLang 0.5.23 server on CPU with DDTREE (4.4 min from a fresh clone here);
# DEMO_HOST=ct129 deploys the lab engine, our stand-in, instead.
# Needs root (namespaces, mounts). Leaves the lab running; `ddtree lab down --name default` removes it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"
HOST=${DEMO_HOST:-ct131}
ADDRESS=10.213.0.$((${HOST#ct}))   # the default lab (inventories/lab/hosts.yml): 10.213.0.<n>
PORT=30000

if [ "$(id -u)" -ne 0 ]; then
    echo "make demo needs root: lab hosts are network namespaces and systemd-nspawn machines" >&2
    exit 1
fi
step() { printf '\n==> %s\n' "$*"; }
# JSON, indented, with lists of numbers kept on one line (token ids, histograms).
pretty() {
    python -c 'import json, re, sys
text = json.dumps(json.load(sys.stdin), indent=2)
print(re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text))'
}
started=$SECONDS

step "Lab host prerequisites (Debian packages, once)"
bash scripts/lab/prereqs.sh

step "Lab hosts up to $HOST (the first run makes the Debian rootfs: about a minute)"
ddtree lab up --name default --hosts $((${HOST#ct} - 128))

step "Wheelhouse .lab/wheelhouse (CPU torch, SGLang without CUDA, this checkout's wheel)"
ddtree lab wheelhouse

step "ansible-playbook deploy.yml -i inventories/lab -l $HOST (lab models are made on the host)"
ansible-playbook deploy.yml -i inventories/lab -l "$HOST"

ssh_host() {
    ssh -i .lab/default/id_ed25519 -o IdentitiesOnly=yes -o BatchMode=yes \
        -o UserKnownHostsFile=.lab/default/known_hosts -o StrictHostKeyChecking=accept-new \
        -o LogLevel=ERROR "root@$ADDRESS" "$@"
}

step "Probe report ($HOST:/var/lib/ddtree/probe/sglang-qwen.json)"
ssh_host cat /var/lib/ddtree/probe/sglang-qwen.json | pretty

step "Service on $HOST"
ssh_host systemctl --no-pager --lines=0 status sglang-qwen.service 2>/dev/null | head -5 || true

REQUEST='{"text": "The lab host says", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}'
step "A request from this machine to the service"
echo "curl -s http://$ADDRESS:$PORT/generate -H 'Content-Type: application/json' -d '$REQUEST'"
curl -sS --max-time 60 "http://$ADDRESS:$PORT/generate" -H 'Content-Type: application/json' -d "$REQUEST" \
    | pretty

step "Done in $((SECONDS - started)) s"
cat <<EOF
The service runs on lab host $HOST ($ADDRESS:$PORT). Try:
  curl -s http://$ADDRESS:$PORT/generate -H 'Content-Type: application/json' -d '$REQUEST'
  curl -s http://$ADDRESS:$PORT/server_info
  ddtree lab status --name default          # the lab hosts
  ansible-playbook deploy.yml -i inventories/lab -l $HOST -e sglang_profile=shadow-small
  ddtree lab down --name default            # remove the lab hosts
EOF
