"""Which router workers a rollout takes out and puts back, and whether it may (roles/sglang_rotation).

The plays read each router's worker list (sglang-router's `GET /workers`) and hand it here with the
inventory's view of the fleet; this module decides and the plays act (`DELETE` / `POST /workers`). A
host that serves through a router is never taken out when no other worker of that router would be left
healthy (unless it is the router's only configured worker: then the answer says what downtime to expect).
`ddtree fleet status` uses `host_states` for its ROTATION column.

What a router says is checked before anything is decided on it (inputs/router_answers.router_workers): ids
before they go into a path, health a JSON boolean, URLs in one spelling (scheme and host case, default
port, trailing '/'), credentials refused; only http(s) workers whose host is an IP address count as
serving capacity (a DNS name may be this very host). An answer that cannot be read is exit 2: no change.

Run by the plays on the controller as `python -m ddtree_runtime.ops.rotation leave|join|remove|exposure` with
one JSON document on stdin (exposure: whether the routers reach the host's SGLang at all, its preflight);
prints one JSON document. Exit 0: go on; 1: refused (the reason says why and what
to do); 2: bad input (the reason names the router, the entry and the rule).
"""

from __future__ import annotations

import ipaddress
import json
import math
import sys
import urllib.parse
from dataclasses import dataclass
from typing import Any

from ddtree_runtime.inputs.router_answers import router_workers
from ddtree_runtime.inputs.router_answers import worker_url as normal_url
from ddtree_runtime.inputs.values import InputError, as_bool, as_int, one_line

EXIT_GO, EXIT_REFUSED, EXIT_BAD_INPUT = 0, 1, 2
MAX_STDIN = 16 * 1024 * 1024


class RotationInputError(ValueError):
    """The document on stdin is not what the plays send: exit 2 with what was wrong."""


@dataclass(frozen=True)
class Member:
    """A host the inventory puts behind a router: its inventory name and the address the router uses."""

    host: str
    address: str


@dataclass(frozen=True)
class RouterView:
    """One router: its inventory name, the workers the inventory gives it, what it routes to now.

    `workers` is the router's GET /workers answer (its object, its list, or entries): checked here,
    kept as {id, url, is_healthy} with the URL in one spelling; InputError when it cannot be read."""

    name: str
    members: tuple[Member, ...]
    workers: tuple[dict[str, Any], ...]

    def __post_init__(self) -> None:
        answer = list(self.workers) if isinstance(self.workers, tuple) else self.workers
        object.__setattr__(self, "workers", tuple(router_workers(answer, self.name)))
        object.__setattr__(
            self, "members", tuple(Member(m.host, address_key(m.address)) for m in self.members)
        )

    def entries_of(self, urls: set[str]) -> list[dict[str, Any]]:
        wanted = {normal_url(u) for u in urls}
        return [w for w in self.workers if w["url"] in wanted]

    def entries_at(self, address: str) -> list[dict[str, Any]]:
        return [w for w in self.workers if url_address(w["url"]) == address_key(address)]


def address_key(address: str) -> str:
    """An IP address in one spelling (compressed, lower case); another string as it is."""
    try:
        return ipaddress.ip_address(address.strip("[]")).compressed
    except ValueError:
        return address


def url_address(url: str) -> str:
    """The host part of a worker URL (no brackets around an IPv6 address)."""
    return address_key(urllib.parse.urlsplit(url).hostname or "")


def serves(worker: dict[str, Any]) -> bool:
    """Healthy capacity the rotation may count on: the router says healthy (a JSON true) and the host is
    an IP address, so it can be told apart from the leaving host (a DNS name may be that very host)."""
    if worker["is_healthy"] is not True:
        return False
    try:
        ipaddress.ip_address(url_address(worker["url"]))
    except ValueError:
        return False
    return True


def worker_url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"


def _member_state(router: RouterView, member: Member, batch: set[str]) -> str:
    entries = router.entries_at(member.address)
    if member.address in batch:
        return "in this batch"
    if not entries:
        return "not in rotation"
    return "in rotation" if any(w["is_healthy"] for w in entries) else "in rotation but UNHEALTHY"


def plan_leave(
    host: str,
    urls: set[str],
    batch_addresses: set[str],
    routers: list[RouterView],
    *,
    allow_single_host: bool,
    restart_bound_s: float,
) -> dict[str, Any]:
    """What to remove from which router before `host` restarts, or why not (ok False)."""
    removals, refusals, warnings = [], [], []
    urls = {str(normal_url(u)) for u in urls}
    batch_addresses = {address_key(a) for a in batch_addresses}
    for router in routers:
        mine = router.entries_of(urls)
        removals += [{"router": router.name, "id": w["id"], "url": w["url"]} for w in mine]
        if not any(w["is_healthy"] for w in mine):
            continue  # it serves nothing through this router now: nobody loses it
        others = [
            w
            for w in router.workers
            if w["url"] not in urls and serves(w) and url_address(w["url"]) not in batch_addresses
        ]
        if others:
            continue
        rest = [m for m in router.members if m.host != host]
        if not rest:
            downtime = (
                f"{host} is the only worker of router {router.name}: requests through it fail until "
                f"{host} is back, up to {restart_bound_s:.0f} s (its stop plus its ready timeout)"
            )
            if allow_single_host:
                warnings.append(downtime + ".")
            else:
                refusals.append(
                    downtime + "; refused (sglang_rotation_allow_single_host_downtime is false). "
                    "Add a second worker to the router, or allow the downtime."
                )
            continue
        states = ", ".join(f"{m.host} {_member_state(router, m, batch_addresses)}" for m in rest)
        refusals.append(
            f"{host} is the last healthy worker of router {router.name} ({states}): taking it out would "
            "leave the router nothing to serve with. Nothing was changed. Bring the others back first "
            "(ddtree fleet status; ansible-playbook ansible/rotation.yml -l HOST -e rotation=join), or roll "
            f"out with -e sglang_rotation_enabled=false and accept failed requests while {host} restarts."
        )
    return {
        "ok": not refusals,
        "reason": " ".join(refusals) or None,
        "warnings": warnings,
        "removals": removals,
    }


def plan_join(url: str, routers: list[RouterView]) -> dict[str, Any]:
    """Which routers must add `url` (the others list it already, in any spelling of it)."""
    additions = [r.name for r in routers if not r.entries_of({url})]
    return {
        "ok": True,
        "additions": additions,
        "already": [r.name for r in routers if r.name not in additions],
    }


def plan_remove(url: str, routers: list[RouterView]) -> dict[str, Any]:
    """Which entries to DELETE so that no router lists `url` (a canary's shadow): checked ids only."""
    removals = [
        {"router": r.name, "id": w["id"], "url": w["url"]} for r in routers for w in r.entries_of({url})
    ]
    return {"ok": True, "removals": removals}


def host_states(routers: list[RouterView]) -> dict[str, list[str]]:
    """host -> one 'router: state' per router it is configured behind (for `ddtree fleet status`)."""
    states: dict[str, list[str]] = {}
    for router in routers:
        for member in router.members:
            entries = router.entries_at(member.address)
            if not entries:
                state = "out"
            elif any(w["is_healthy"] for w in entries):
                state = "in"
            else:
                state = "in (unhealthy)"
            states.setdefault(member.host, []).append(f"{router.name}: {state}")
    return states


# ---------------------------------------------------------------------------- the plays' JSON


def plan_exposure(host: str, allowed: list[str], routers: list[tuple[str, str]]) -> dict[str, Any]:
    """Whether the routers in front of a host reach its SGLang: it listens on every address (0.0.0.0 or ::)
    and its address filter (sglang_service_allowed_clients) admits each router's address."""
    words = ("any", "localhost", "link-local")
    nets = [ipaddress.ip_network(a, strict=False) for a in allowed if a not in words]
    bad = []
    for name, address in routers:
        try:
            admitted = "any" in allowed or any(ipaddress.ip_address(address) in net for net in nets)
        except ValueError:
            reason = f"the router address {address!r} is not an IP address (set its ansible_host)"
            return {"ok": False, "reason": reason}
        if not admitted:
            bad.append(f"{name} ({address})")
    if host not in ("0.0.0.0", "::") or bad:
        shown = allowed or "only localhost"
        reached = ", ".join(bad) or "every router (loopback only)"
        return {"ok": False, "reason": f"SGLang listens on {host} and admits {shown}; not reached: {reached}"}
    return {"ok": True, "reason": ""}


def _exposure(doc: dict[str, Any]) -> dict[str, Any]:
    host, allowed, routers = doc.get("host"), doc.get("allowed"), doc.get("routers")
    strings = isinstance(allowed, list) and all(isinstance(a, str) for a in allowed)
    if not isinstance(host, str) or not strings:
        raise RotationInputError("'host' must be an address and 'allowed' a list of CIDRs")
    if not isinstance(routers, list) or not all(
        isinstance(r, list) and len(r) == 2 and all(isinstance(x, str) for x in r) for r in routers
    ):
        raise RotationInputError("'routers' must be a list of [name, address]")
    try:
        return plan_exposure(host, allowed, [(name, address) for name, address in routers])
    except ValueError as exc:  # an allowed entry that is no network (the service preflight refuses it first)
        raise RotationInputError(f"'allowed': {str(exc)[:200]}") from None


def _routers(doc: dict[str, Any]) -> list[RouterView]:
    routers = doc.get("routers")
    if not isinstance(routers, list) or len(routers) > 256:
        raise RotationInputError("'routers' must be a list of {name, members, workers}")
    views = []
    for r in routers:
        name = r.get("name") if isinstance(r, dict) else None
        if not isinstance(name, str) or not name or one_line("name", name, limit=255):
            raise RotationInputError(f"each router needs a one-line 'name': got {r!r:.200}")
        members = r.get("members") or []
        if not isinstance(members, list) or not all(
            isinstance(m, dict) and isinstance(m.get("host"), str) and isinstance(m.get("address"), str)
            for m in members
        ):
            raise RotationInputError(f"router {r['name']}: 'members' must be [{{host, address}}] strings")
        try:
            views.append(
                RouterView(
                    r["name"], tuple(Member(m["host"], m["address"]) for m in members), r.get("workers")
                )
            )
        except InputError as exc:
            raise RotationInputError(f"{exc}; nothing was decided on it") from None
    return views


def _strings(doc: dict[str, Any], key: str) -> set[str]:
    value = doc.get(key, [])
    if not isinstance(value, list) or len(value) > 256 or not all(isinstance(v, str) for v in value):
        raise RotationInputError(f"'{key}' must be a list of strings")
    return set(value)


def _url(name: str, value: Any) -> str:
    """One of the plays' own worker URLs: an http(s) URL, in worker_url's spelling."""
    try:
        url = normal_url(value, name)
    except InputError as exc:
        raise RotationInputError(str(exc)) from None
    if url is None:
        raise RotationInputError(f"'{name}' must be an http(s) worker URL: got {value!r:.200}")
    return url


def run(action: str, doc: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    if not isinstance(doc, dict):
        raise RotationInputError("stdin must hold one JSON object")
    if action not in ("leave", "join", "remove", "exposure"):
        raise RotationInputError(f"unknown action {action!r}: leave, join, remove or exposure")
    if action == "exposure":
        answer = _exposure(doc)
        return (EXIT_GO if answer["ok"] else EXIT_REFUSED), answer
    routers = _routers(doc)
    if action == "leave":
        host, bound = doc.get("host"), doc.get("restart_bound_s", 0)
        allow = as_bool(doc.get("allow_single_host", True))
        if not isinstance(host, str) or not host or one_line("host", host, limit=255):
            raise RotationInputError(f"'host' must be the inventory name: got {host!r:.200}")
        if allow is None:
            shown = repr(doc.get("allow_single_host"))[:80]
            raise RotationInputError(f"'allow_single_host' must be a boolean: got {shown}")
        seconds = as_int(bound) if isinstance(bound, str) else bound  # templated: maybe its digits
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds < math.inf:
            raise RotationInputError(f"'restart_bound_s' must be a number of seconds: got {bound!r:.80}")
        answer = plan_leave(
            host,
            {_url("urls", u) for u in _strings(doc, "urls")},
            _strings(doc, "batch_addresses"),
            routers,
            allow_single_host=allow,
            restart_bound_s=float(seconds),
        )
    elif action == "join":
        answer = plan_join(_url("url", doc.get("url")), routers)
    else:
        answer = plan_remove(_url("url", doc.get("url")), routers)
    return (EXIT_GO if answer["ok"] else EXIT_REFUSED), answer


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if len(args) != 1:
            usage = "usage: python -m ddtree_runtime.ops.rotation leave|join|remove|exposure < doc"
            raise RotationInputError(usage)
        try:
            doc = json.loads(sys.stdin.read(MAX_STDIN + 1)[: MAX_STDIN + 1] or "null")
        except (ValueError, RecursionError) as exc:
            raise RotationInputError(f"stdin is not JSON: {str(exc)[:200]}") from None
        code, answer = run(args[0], doc)
    except RotationInputError as exc:
        print(json.dumps({"ok": False, "reason": f"bad input: {exc}"}))
        return EXIT_BAD_INPUT
    print(json.dumps(answer))
    return code


if __name__ == "__main__":
    sys.exit(main())
