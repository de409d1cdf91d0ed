"""What a router says (GET /workers), checked before anything is decided on it or written from it: ids
that go into a path, worker URLs in one spelling, health a JSON boolean."""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

from .values import InputError, bad_chars, problem, show

# A router's worker id goes into DELETE /workers/<id>: sglang-router's are UUIDs; no '/', '?', '%'.
_WORKER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_HOST_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,62})(\.[a-z0-9]([a-z0-9-]{0,62}))*\.?")
_URL_PATH = re.compile(r"(/[A-Za-z0-9._~-]+)*")
MAX_WORKERS = 4096


def worker_url(url: Any, name: str = "a worker URL") -> str | None:
    """One spelling of an http(s) worker URL, to compare and to write: scheme and host in lower case, an
    IPv6 address compressed in brackets, the port always written (80/443 when left out), no trailing
    '/'. None for another scheme (not a worker that serves). InputError, naming it, for a URL that cannot
    be read safely: not a string, too long, a space or control character, credentials, a query."""
    if not isinstance(url, str) or not url or len(url) > 2048:
        raise InputError(problem(name, url, "is not a URL string (1-2048 characters)"))
    if bad_chars(url) or any(ch.isspace() for ch in url):
        raise InputError(problem(name, url, "holds a space or a control character"))
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        return None
    if "@" in parts.netloc:
        raise InputError(problem(name, url, "holds credentials (user:pass@)", secret=True))
    if parts.query or parts.fragment or "?" in url or "#" in url or "%" in parts.netloc:
        raise InputError(problem(name, url, "holds a query, a fragment or an escape: not a worker URL"))
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        raise InputError(problem(name, url, "has no valid port (1-65535)")) from None
    host = (parts.hostname or "").lower()
    try:
        address = ipaddress.ip_address(host)
        host = f"[{address.compressed}]" if address.version == 6 else address.compressed
    except ValueError:
        if not _HOST_NAME.fullmatch(host) or len(host) > 253:
            raise InputError(problem(name, url, "has no valid host (an IP address or a DNS name)")) from None
    path = parts.path.rstrip("/")
    if not _URL_PATH.fullmatch(path):
        raise InputError(problem(name, url, "has a path a worker URL does not have"))
    return f"{scheme}://{host}:{port}{path}"


def router_workers(answer: Any, router: str) -> list[dict[str, Any]]:
    """A router's GET /workers answer ({"workers": [...]} or the list) as [{id, url, is_healthy}]: each id
    checked before it goes into a path, each URL in worker_url's spelling, health a JSON boolean (not a
    truthy string), ids unique and one per URL (a DELETE by id then removes the worker meant). Workers of
    another scheme are left out (they serve no http traffic of ours). Anything else is InputError, one line
    naming the router and the entry: a decision makes no change on it. The result is itself such an answer
    (checking it again gives it back)."""
    listing = answer.get("workers") if isinstance(answer, Mapping) else answer
    if not isinstance(listing, list):
        raise InputError(f"router {router}: its GET /workers answer {show(answer)} is not a worker list")
    if len(listing) > MAX_WORKERS:
        raise InputError(f"router {router}: lists {len(listing)} workers, more than {MAX_WORKERS}")
    workers = []
    ids: dict[str, int] = {}
    urls: dict[str, str] = {}
    for i, entry in enumerate(listing):
        where = f"router {router} worker {i}"
        if not isinstance(entry, Mapping):
            raise InputError(problem(where, entry, "is not an object {id, url, is_healthy}"))
        wid, healthy = entry.get("id"), entry.get("is_healthy")
        if not isinstance(wid, str) or not _WORKER_ID.fullmatch(wid):
            raise InputError(problem(f"{where} id", wid, "is not a worker id: 1-128 of letters, digits and "
                                     "'_.-', starting with a letter or digit"))
        if wid in ids:  # a DELETE /workers/<id> meant for one of them could remove the other
            raise InputError(f"router {router}: workers {ids[wid]} and {i} share the id {wid!r}: a removal "
                             "by id could take out the wrong one; nothing is decided on this answer")
        ids[wid] = i
        if not isinstance(healthy, bool):
            raise InputError(problem(f"{where} is_healthy", healthy, "is not a JSON boolean"))
        url = worker_url(entry.get("url"), f"{where} url")
        if url is not None and url in urls:
            raise InputError(f"router {router}: {url} is listed twice (ids {urls[url]!r} and {wid!r}): ids "
                             "do not map one to one onto worker URLs; nothing is decided on this answer")
        if url is not None:
            urls[url] = wid
            workers.append({"id": wid, "url": url, "is_healthy": healthy})
    return workers


def router_lists(answer: Any, urls: Any, *, healthy: bool = False) -> bool | None:
    """Whether a router's answer lists one of `urls` (healthy, when asked), in worker_url's spelling;
    None when the answer cannot be read (a wait goes on waiting)."""
    try:
        wanted = {worker_url(u) for u in ([urls] if isinstance(urls, str) else urls)}
        listed = router_workers(answer, "-")
        return any(w["url"] in wanted and (w["is_healthy"] or not healthy) for w in listed)
    except (InputError, TypeError):
        return None


def router_rotation_urls(answer: Any, router: str) -> list[str]:
    """The URLs a router's rotation file keeps (read at its next start): its http(s) workers, checked and
    in one spelling, sorted. InputError when the answer cannot be read: nothing is written then."""
    return sorted({w["url"] for w in router_workers(answer, router)})
