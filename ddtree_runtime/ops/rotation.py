"""Which router workers a rollout takes out and puts back, and whether it may (roles/sglang_rotation).

The plays read each router's worker list (sglang-router's `GET /workers`) and hand it here with the
inventory's view of the fleet; this module decides and the plays act (`DELETE` / `POST /workers`). A
host that serves through a router is never taken out when no other worker of that router would be left
healthy (unless it is the router's only configured worker: then the answer says what downtime to expect).
`ddtree fleet status` uses `host_states` for its ROTATION column.

Run by the plays on the controller as `python -m ddtree_runtime.ops.rotation leave|join` with one JSON
document on stdin; prints one JSON document. Exit 0: go on; 1: refused (the reason says why and what to
do); 2: bad input.
"""

from __future__ import annotations

import json
import sys
import urllib.parse
from dataclasses import dataclass
from typing import Any

EXIT_GO, EXIT_REFUSED, EXIT_BAD_INPUT = 0, 1, 2


class RotationInputError(ValueError):
    """The document on stdin is not what the plays send: exit 2 with what was wrong."""


@dataclass(frozen=True)
class Member:
    """A host the inventory puts behind a router: its inventory name and the address the router uses."""

    host: str
    address: str


@dataclass(frozen=True)
class RouterView:
    """One router: its inventory name, the workers the inventory gives it, what it routes to now."""

    name: str
    members: tuple[Member, ...]
    workers: tuple[dict[str, Any], ...]  # GET /workers entries: id, url, is_healthy, ...

    def entries_of(self, urls: set[str]) -> list[dict[str, Any]]:
        return [w for w in self.workers if w.get("url") in urls]

    def entries_at(self, address: str) -> list[dict[str, Any]]:
        return [w for w in self.workers if url_address(str(w.get("url", ""))) == address]


def url_address(url: str) -> str:
    """The host part of a worker URL (no brackets around an IPv6 address)."""
    return urllib.parse.urlsplit(url).hostname or ""


def worker_url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"


def _member_state(router: RouterView, member: Member, batch: set[str]) -> str:
    entries = router.entries_at(member.address)
    if member.address in batch:
        return "in this batch"
    if not entries:
        return "not in rotation"
    return "in rotation" if any(w.get("is_healthy") for w in entries) else "in rotation but UNHEALTHY"


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
    for router in routers:
        mine = router.entries_of(urls)
        removals += [{"router": router.name, "id": w["id"], "url": w["url"]} for w in mine]
        if not any(w.get("is_healthy") for w in mine):
            continue  # it serves nothing through this router now: nobody loses it
        others = [
            w
            for w in router.workers
            if w.get("url") not in urls
            and w.get("is_healthy")
            and url_address(str(w.get("url", ""))) not in batch_addresses
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
    """Which routers must add `url` (the others list it already)."""
    additions = [r.name for r in routers if not r.entries_of({url})]
    return {
        "ok": True,
        "additions": additions,
        "already": [r.name for r in routers if r.name not in additions],
    }


def host_states(routers: list[RouterView]) -> dict[str, list[str]]:
    """host -> one 'router: state' per router it is configured behind (for `ddtree fleet status`)."""
    states: dict[str, list[str]] = {}
    for router in routers:
        for member in router.members:
            entries = router.entries_at(member.address)
            if not entries:
                state = "out"
            elif any(w.get("is_healthy") for w in entries):
                state = "in"
            else:
                state = "in (unhealthy)"
            states.setdefault(member.host, []).append(f"{router.name}: {state}")
    return states


# ---------------------------------------------------------------------------- the plays' JSON


def _routers(doc: dict[str, Any]) -> list[RouterView]:
    routers = doc.get("routers")
    if not isinstance(routers, list):
        raise RotationInputError("'routers' must be a list of {name, members, workers}")
    views = []
    for r in routers:
        if not isinstance(r, dict) or not isinstance(r.get("name"), str):
            raise RotationInputError(f"each router needs a 'name': got {r!r:.200}")
        listing = r.get("workers")
        if isinstance(listing, dict):  # the router's own answer: {"workers": [...], "total": N, ...}
            listing = listing.get("workers")
        if not isinstance(listing, list) or not all(isinstance(w, dict) and "url" in w for w in listing):
            raise RotationInputError(f"router {r['name']}: 'workers' must be its GET /workers answer")
        members = r.get("members") or []
        if not all(isinstance(m, dict) and {"host", "address"} <= set(m) for m in members):
            raise RotationInputError(f"router {r['name']}: 'members' must be [{{host, address}}]")
        views.append(
            RouterView(
                r["name"], tuple(Member(str(m["host"]), str(m["address"])) for m in members), tuple(listing)
            )
        )
    return views


def _strings(doc: dict[str, Any], key: str) -> set[str]:
    value = doc.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RotationInputError(f"'{key}' must be a list of strings")
    return set(value)


def run(action: str, doc: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    if not isinstance(doc, dict):
        raise RotationInputError("stdin must hold one JSON object")
    routers = _routers(doc)
    if action == "leave":
        answer = plan_leave(
            str(doc.get("host")),
            _strings(doc, "urls"),
            _strings(doc, "batch_addresses"),
            routers,
            allow_single_host=bool(doc.get("allow_single_host", True)),
            restart_bound_s=float(doc.get("restart_bound_s", 0)),
        )
    elif action == "join":
        if not isinstance(doc.get("url"), str):
            raise RotationInputError("'url' must be the worker URL to add")
        answer = plan_join(doc["url"], routers)
    else:
        raise RotationInputError(f"unknown action {action!r}: leave or join")
    return (EXIT_GO if answer["ok"] else EXIT_REFUSED), answer


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if len(args) != 1:
            raise RotationInputError("usage: python -m ddtree_runtime.ops.rotation leave|join < doc.json")
        try:
            doc = json.load(sys.stdin)
        except ValueError as exc:
            raise RotationInputError(f"stdin is not JSON: {exc}") from exc
        code, answer = run(args[0], doc)
    except RotationInputError as exc:
        print(json.dumps({"ok": False, "reason": f"bad input: {exc}"}))
        return EXIT_BAD_INPUT
    print(json.dumps(answer))
    return code


if __name__ == "__main__":
    sys.exit(main())
