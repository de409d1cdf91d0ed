"""One operator value at a time: what each may contain, and a refusal that names the variable, shows
the value and says the rule.

Stdlib only, and imports nothing outside ``inputs/``: ansible/filter_plugins/ddtree_inputs.py loads the
folder by file path on the controller.
"""

from __future__ import annotations

import ipaddress
import math
import posixpath
import re
import unicodedata
from typing import Any

# systemd unit names: letters, digits and ":-_.\@" (systemd.unit(5)); ours also start with a letter or
# digit, never hold "..", and come without the ".service" suffix (the roles add it).
UNIT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,99}")
# System account and group names the roles create (useradd's portable set).
_ACCOUNT = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
# Paths that go into unit directives taking lists or into other paths: no spaces, quotes or globs.
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9._/+@=,:-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
NUMBER = re.compile(r"-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_RELEASE_ID = re.compile(r"[0-9a-f]{16}")
_GPU_ID = re.compile(r"\d{1,3}|GPU-[0-9a-fA-F-]{8,64}|MIG-[0-9a-fA-F/-]{8,80}")
_TIMESPAN = re.compile(r"[1-9][0-9]{0,6}(s|min|h)")
# The words Ansible's own bool type reads (module_utils.parsing.convert_bool), and no others.
BOOL_WORDS = {"true": True, "yes": True, "on": True, "1": True, "y": True, "t": True,
              "false": False, "no": False, "off": False, "0": False, "n": False, "f": False}
MAX_VALUE_CHARS = 4096
MAX_LIST_ITEMS = 256


class InputError(ValueError):
    """A value that must not reach a host: the message names it, shows it and says the rule."""


def show(value: Any) -> str:
    """The value as the operator typed it, control characters visible, cut to a readable length."""
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def problem(name: str, value: Any, rule: str, *, secret: bool = False) -> str:
    return f"{name}: {'(value hidden)' if secret else show(value)} {rule}"


def bad_chars(text: str) -> str | None:
    """The first control or line-breaking character, named (they end a unit or env-file line)."""
    for ch in text:
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"):
            return f"{ch!r} (U+{ord(ch):04X})"
    return None


def one_line(name: str, value: Any, *, secret: bool = False, limit: int = MAX_VALUE_CHARS) -> str | None:
    """A problem when the text holds a control character or is too long, else None."""
    text = str(value)
    bad = bad_chars(text)
    if bad:
        return problem(name, value, f"holds the control character {bad}: one printable line only",
                       secret=secret)
    if len(text) > limit:
        return problem(name, value, f"is {len(text)} characters long: at most {limit}", secret=secret)
    return None


def collect(*found: str | list[str] | None) -> list[str]:
    """The problems found, in order: each rule gives one (a string), none (None) or several (a list)."""
    out: list[str] = []
    for item in found:
        if isinstance(item, list):
            out += item
        elif item:
            out.append(item)
    return out


def unit_name(name: str, value: Any) -> str | None:
    if not isinstance(value, str) or not UNIT_NAME.fullmatch(value) or ".." in value:
        return problem(name, value, "is not a unit name: 1-100 of letters, digits and '_.@-', starting with "
                       "a letter or digit, no '..' (e.g. sglang-qwen)")
    if value.endswith((".service", ".")):
        return problem(name, value, "is given without '.service' (e.g. sglang-qwen)")
    return None


def account(name: str, value: Any) -> str | None:
    if not isinstance(value, str) or not _ACCOUNT.fullmatch(value):
        return problem(name, value, "is not a system account name: 1-32 of a-z, 0-9, '_' and '-', "
                       "starting with a letter or '_'")
    if value == "root":
        return problem(name, value, "is root: the service runs as a dedicated unprivileged account "
                       "(the role creates it; the default is fine)")
    return None


def existing_account(name: str, value: str, passwd_line: str, *, home: str, shell: str) -> str | None:
    """The account's ``getent passwd`` line, when it exists: refuse one the role would rewrite."""
    fields = passwd_line.strip().split(":")
    if not passwd_line.strip():
        return None
    if len(fields) < 7:
        return problem(name, value, f"has an unreadable passwd entry {show(passwd_line)}")
    uid, have_home, have_shell = fields[2], fields[5], fields[6]
    if uid == "0":
        return problem(name, value, "has uid 0 on the host: the service never runs as root")
    if have_home != home or have_shell != shell:
        return problem(name, value, f"already exists on the host with home {have_home} and shell "
                       f"{have_shell}: the role would rewrite them to {home} and {shell}; pick a name "
                       "of its own (the default is fine)")
    return None


def abs_path(name: str, value: Any, *, plain: bool = True) -> str | None:
    """An absolute, normalised path (no '..', '//', '/./' or trailing '/').

    ``plain``: also no spaces, quotes or other characters that unit directives taking lists (or a
    path joined to another) would split or expand; model paths may hold them (they are quoted).
    """
    if not isinstance(value, str) or not value.startswith("/"):
        return problem(name, value, "is not an absolute path (it must start with '/')")
    bad = one_line(name, value, limit=1024)
    if bad:
        return bad
    if posixpath.normpath(value) != value or value.startswith("//"):
        return problem(name, value, f"is not a normalised path (did you mean "
                       f"{posixpath.normpath(value)!r}?)")
    if plain and not _PLAIN_PATH.fullmatch(value):
        return problem(name, value, "holds characters a unit directive would split or expand: letters, "
                       "digits and '._/+@=,:-' only")
    return None


def release_id(name: str, value: Any) -> str | None:
    if not isinstance(value, str) or not _RELEASE_ID.fullmatch(value):
        return problem(name, value, "is not a release id (16 hex digits, as the runtime role names "
                       "releases)")
    return None


def integer(name: str, value: Any, low: int, high: int) -> str | None:
    """An integer (or its digits, as ``-e name=value`` gives it) in [low, high]."""
    number = as_int(value)
    if number is None:
        return problem(name, value, f"is not a whole number (expected {low}..{high})")
    if not low <= number <= high:
        return problem(name, value, f"is out of range: {low}..{high}")
    return None


def as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"-?\d{1,18}", value):
        return int(value)
    return None


def port(name: str, value: Any, *, zero_means: str | None = None) -> str | None:
    """1..65535; 0 too when ``zero_means`` says what 0 stands for (e.g. "the profile's port")."""
    low = 0 if zero_means else 1
    bad = integer(name, value, low, 65535)
    if bad:
        return bad + (f" (0 = {zero_means})" if zero_means else "")
    return None


def number(name: str, value: Any, low: float, high: float, *, low_open: bool = False) -> str | None:
    try:
        x = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        x = math.nan
    if not math.isfinite(x) or x > high or x < low or (low_open and x == low):
        bracket = "(" if low_open else "["
        return problem(name, value, f"is not a number in {bracket}{low:g}, {high:g}]")
    return None


def strict_bool(name: str, value: Any) -> str | None:
    """True/False, or a word Ansible reads as one: a string like 'flase' is refused, not truthy."""
    return None if as_bool(value) is not None else problem(
        name, value, "is not a boolean: true or false (yes/no, on/off, 1/0 also read)")


def as_bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        return BOOL_WORDS.get(value.lower())
    return None


def env_name(name: str, key: Any) -> str | None:
    if not isinstance(key, str) or not _ENV_NAME.fullmatch(key):
        return problem(name, key, "is not an environment variable name: letters, digits and '_', "
                       "not starting with a digit")
    return None


def env_value(name: str, value: Any, *, secret: bool = False) -> str | None:
    if isinstance(value, bool) or value is None or not isinstance(value, str | int | float):
        return problem(name, value, "is not a string or a number (quote it in YAML, e.g. '1' or 'true')",
                       secret=secret)
    return one_line(name, value, secret=secret)


def visible_devices(name: str, value: Any) -> str | None:
    """CUDA_VISIBLE_DEVICES: empty, or GPU indices / UUIDs separated by commas, each once."""
    text = "" if value is None else str(value)
    if text == "":
        return None
    ids = text.split(",")
    if len(ids) > 64 or not all(_GPU_ID.fullmatch(i) for i in ids):
        return problem(name, value, "is not a list of GPUs: indices or GPU-/MIG- UUIDs separated by commas, "
                       "no spaces (e.g. 0 or 0,1)")
    seen = {i.lstrip("0") or "0" if i.isdigit() else i for i in ids}
    if len(seen) != len(ids):
        return problem(name, value, "names a GPU twice: each visible device once (two ranks on one GPU "
                       "do not fit)")
    return None


def clients(name: str, value: Any) -> str | None:
    """IPAddressAllow= entries: addresses or CIDRs, or systemd's any/localhost/link-local/multicast."""
    if not isinstance(value, list) or len(value) > MAX_LIST_ITEMS:
        return problem(name, value, "is not a list of addresses or CIDRs")
    for item in value:
        if item in ("any", "localhost", "link-local", "multicast"):
            continue
        try:
            ipaddress.ip_network(str(item), strict=False)
        except ValueError:
            return problem(f"{name} entry", item, "is not an IP address or CIDR (e.g. 10.0.4.0/24), nor "
                           "any/localhost/link-local/multicast")
        if not isinstance(item, str) or not re.fullmatch(r"[0-9a-fA-F.:]+(/\d{1,3})?", item):
            return problem(f"{name} entry", item, "is not written as an address or CIDR (e.g. 10.0.4.0/24)")
    return None


def listen_address(name: str, value: Any) -> str | None:
    if value == "localhost":
        return None
    try:
        ipaddress.ip_address(str(value))
    except ValueError:
        return problem(name, value, "is not an IP address to listen on (e.g. 127.0.0.1, 0.0.0.0 or ::)")
    return None if isinstance(value, str) and "%" not in value else problem(
        name, value, "is not an IP address to listen on (e.g. 127.0.0.1)")


def timespan(name: str, value: Any) -> str | None:
    if not isinstance(value, str) or not _TIMESPAN.fullmatch(value):
        return problem(name, value, "is not a systemd time span like 30s, 15min or 1h")
    return None


def string_list(name: str, value: Any, *, limit: int = MAX_LIST_ITEMS) -> str | None:
    if not isinstance(value, list) or len(value) > limit:
        return problem(name, value, f"is not a list (of at most {limit} strings)")
    for i, item in enumerate(value):
        if not isinstance(item, str | int | float) or isinstance(item, bool):
            return problem(f"{name}[{i}]", item, "is not a string")
        bad = one_line(f"{name}[{i}]", item)
        if bad:
            return bad
    return None


def ip_address(name: str, value: Any) -> str | None:
    """A literal IPv4 or IPv6 address (a unit's address filter and a worker URL take no names)."""
    try:
        ipaddress.ip_address(value if isinstance(value, str) else "-")
    except ValueError:
        return problem(name, value, "is not an IP address (e.g. 10.0.4.11): a worker's is its "
                       "sglang_rotation_worker_address, else its ansible_host")
    return None
