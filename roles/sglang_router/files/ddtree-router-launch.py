"""Start sglang-router with its control key and workers from the unit's environment, not a command line.

Run by sglang-router.service as `<venv>/bin/python -I ddtree-router-launch.py FLAGS...` (roles/sglang_router).
The pinned router reads its control key from its command line only, and every local user may read any
process's command line (/proc/PID/cmdline; ProtectProc= does not hide a service from others). So this
parses FLAGS plus the key in its own process and runs the router in it: no exec, no child process, no
argv that holds the key. The key stays in this process's environment block (/proc/PID/environ: root and
the router's own user only) and in the 0600 env file.

SGLANG_ROUTER_CONTROL_KEYS: id:name:role:key (the env file); taken out of os.environ once read.
SGLANG_ROUTER_WORKER_URLS: the rotation file's workers, space-separated; a word that is not an http(s)
URL is left out and said in the journal, never read as a flag.
Exit 2 when FLAGS set what only the environment may.
"""

from __future__ import annotations

import os
import re
import sys

# What the rotation tasks write (inputs/router_answers.worker_url's spelling), and a little more.
_WORKER_URL = re.compile(r"https?://(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9.-]{1,253})(:[0-9]{1,5})?/?")
_ENV_ONLY = ("--control-plane-api-keys", "--worker-urls")


def router_args(argv: list[str], environ: dict[str, str] | os._Environ[str]) -> list[str]:
    """FLAGS, then the key and the workers from the environment (the last of a repeated flag wins)."""
    for word in argv:
        name = word.partition("=")[0]
        if len(name) > 2 and name.startswith("--") and any(o.startswith(name) for o in _ENV_ONLY):
            raise SystemExit(f"ddtree-router-launch: {name} comes from the environment only (the env file)")
    keys = environ.pop("SGLANG_ROUTER_CONTROL_KEYS", "")
    urls = []
    for word in environ.get("SGLANG_ROUTER_WORKER_URLS", "").split():
        if _WORKER_URL.fullmatch(word):
            urls.append(word)
        else:
            print(f"ddtree-router-launch: left out {word[:200]!r}: not an http(s) URL", file=sys.stderr)
    return [*argv, *(["--control-plane-api-keys", keys] if keys else []), "--worker-urls", *urls]


def main() -> int:
    try:
        args = router_args(sys.argv[1:], os.environ)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    from sglang_router.launch_router import launch_router, parse_router_args

    launch_router(parse_router_args(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
