"""Operator input checked before it reaches a host, and quoted for where it goes.

One set of rules for every value the roles put into a unit file, an env file, a flag list, a file
name or a command: what each may contain, and systemd's own quoting for what passes
(systemd.syntax(7), systemd.service(5) "Command lines", systemd.exec(7) ``EnvironmentFile=``).
A refusal names the variable, the value and the rule.

The roles call it through ``ansible/filter_plugins/ddtree_inputs.py`` on the controller, in their
preflight, before anything changes on any host; ``ddtree plan`` splits launch flags with it. Stdlib
only and imports nothing of ours: the filter plugin loads it by file path.
"""

from __future__ import annotations

import ipaddress
import math
import posixpath
import re
import unicodedata
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

# systemd unit names: letters, digits and ":-_.\@" (systemd.unit(5)); ours also start with a letter or
# digit, never hold "..", and come without the ".service" suffix (the roles add it).
_UNIT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,99}")
# System account and group names the roles create (useradd's portable set).
_ACCOUNT = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
# Paths that go into unit directives taking lists or into other paths: no spaces, quotes or globs.
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9._/+@=,:-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_FLAG_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
_LONG_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]{0,63}")
_NUMBER = re.compile(r"-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_RELEASE_ID = re.compile(r"[0-9a-f]{16}")
_GPU_ID = re.compile(r"\d{1,3}|GPU-[0-9a-fA-F-]{8,64}|MIG-[0-9a-fA-F/-]{8,80}")
_DIRECTIVE = re.compile(r"[A-Z][A-Za-z]{1,63}")
_DEVICE_ALLOW = re.compile(r"(char-[a-z0-9_-]+|block-[a-z0-9_-]+|/dev/[A-Za-z0-9/_.:-]+)( [rwm]{1,3})?")
_URL = re.compile(r"https?://[A-Za-z0-9.\[\]:_-]+(/[A-Za-z0-9._/-]*)?")
_REQUIREMENT = re.compile(r"[A-Za-z0-9._\[\],<>=!~+-]+")
_TIMESPAN = re.compile(r"[1-9][0-9]{0,6}(s|min|h)")
# A word ExecStart= may carry as it is: anything else is double-quoted.
_PLAIN_WORD = re.compile(r"[A-Za-z0-9_./:=,+@\[\]-]+")
# The words Ansible's own bool type reads (module_utils.parsing.convert_bool), and no others.
_BOOL_WORDS = {"true": True, "yes": True, "on": True, "1": True, "y": True, "t": True,
               "false": False, "no": False, "off": False, "0": False, "n": False, "f": False}
MAX_VALUE_CHARS = 4096
MAX_LIST_ITEMS = 256


class InputError(ValueError):
    """A value that must not reach a host: the message names it, shows it and says the rule."""


def show(value: Any) -> str:
    """The value as the operator typed it, control characters visible, cut to a readable length."""
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _problem(name: str, value: Any, rule: str, *, secret: bool = False) -> str:
    return f"{name}: {'(value hidden)' if secret else show(value)} {rule}"


def _bad_chars(text: str) -> str | None:
    """The first control or line-breaking character, named (they end a unit or env-file line)."""
    for ch in text:
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"):
            return f"{ch!r} (U+{ord(ch):04X})"
    return None


def one_line(name: str, value: Any, *, secret: bool = False, limit: int = MAX_VALUE_CHARS) -> str | None:
    """A problem when the text holds a control character or is too long, else None."""
    text = str(value)
    bad = _bad_chars(text)
    if bad:
        return _problem(name, value, f"holds the control character {bad}: one printable line only",
                        secret=secret)
    if len(text) > limit:
        return _problem(name, value, f"is {len(text)} characters long: at most {limit}", secret=secret)
    return None


# ---------------------------------------------------------------------------- single values


def unit_name(name: str, value: Any) -> str | None:
    if not isinstance(value, str) or not _UNIT_NAME.fullmatch(value) or ".." in value:
        return _problem(name, value, "is not a unit name: 1-100 of letters, digits and '_.@-', starting with "
                        "a letter or digit, no '..' (e.g. sglang-qwen)")
    if value.endswith((".service", ".")):
        return _problem(name, value, "is given without '.service' (e.g. sglang-qwen)")
    return None


def account(name: str, value: Any) -> str | None:
    if not isinstance(value, str) or not _ACCOUNT.fullmatch(value):
        return _problem(name, value, "is not a system account name: 1-32 of a-z, 0-9, '_' and '-', "
                        "starting with a letter or '_'")
    if value == "root":
        return _problem(name, value, "is root: the service runs as a dedicated unprivileged account "
                        "(the role creates it; the default is fine)")
    return None


def existing_account(name: str, value: str, passwd_line: str, *, home: str, shell: str) -> str | None:
    """The account's ``getent passwd`` line, when it exists: refuse one the role would rewrite."""
    fields = passwd_line.strip().split(":")
    if not passwd_line.strip():
        return None
    if len(fields) < 7:
        return _problem(name, value, f"has an unreadable passwd entry {show(passwd_line)}")
    uid, have_home, have_shell = fields[2], fields[5], fields[6]
    if uid == "0":
        return _problem(name, value, "has uid 0 on the host: the service never runs as root")
    if have_home != home or have_shell != shell:
        return _problem(name, value, f"already exists on the host with home {have_home} and shell "
                        f"{have_shell}: the role would rewrite them to {home} and {shell}; pick a name "
                        "of its own (the default is fine)")
    return None


def abs_path(name: str, value: Any, *, plain: bool = True) -> str | None:
    """An absolute, normalised path (no '..', '//', '/./' or trailing '/').

    ``plain``: also no spaces, quotes or other characters that unit directives taking lists (or a
    path joined to another) would split or expand; model paths may hold them (they are quoted).
    """
    if not isinstance(value, str) or not value.startswith("/"):
        return _problem(name, value, "is not an absolute path (it must start with '/')")
    bad = one_line(name, value, limit=1024)
    if bad:
        return bad
    if posixpath.normpath(value) != value or value.startswith("//"):
        return _problem(name, value, f"is not a normalised path (did you mean "
                        f"{posixpath.normpath(value)!r}?)")
    if plain and not _PLAIN_PATH.fullmatch(value):
        return _problem(name, value, "holds characters a unit directive would split or expand: letters, "
                        "digits and '._/+@=,:-' only")
    return None


def release_id(name: str, value: Any) -> str | None:
    if not isinstance(value, str) or not _RELEASE_ID.fullmatch(value):
        return _problem(name, value, "is not a release id (16 hex digits, as the runtime role names "
                        "releases)")
    return None


def integer(name: str, value: Any, low: int, high: int) -> str | None:
    """An integer (or its digits, as ``-e name=value`` gives it) in [low, high]."""
    number = as_int(value)
    if number is None:
        return _problem(name, value, f"is not a whole number (expected {low}..{high})")
    if not low <= number <= high:
        return _problem(name, value, f"is out of range: {low}..{high}")
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
        return _problem(name, value, f"is not a number in {bracket}{low:g}, {high:g}]")
    return None


def strict_bool(name: str, value: Any) -> str | None:
    """True/False, or a word Ansible reads as one: a string like 'flase' is refused, not truthy."""
    return None if as_bool(value) is not None else _problem(
        name, value, "is not a boolean: true or false (yes/no, on/off, 1/0 also read)")


def as_bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        return _BOOL_WORDS.get(value.lower())
    return None


def env_name(name: str, key: Any) -> str | None:
    if not isinstance(key, str) or not _ENV_NAME.fullmatch(key):
        return _problem(name, key, "is not an environment variable name: letters, digits and '_', "
                        "not starting with a digit")
    return None


def env_value(name: str, value: Any, *, secret: bool = False) -> str | None:
    if isinstance(value, bool) or value is None or not isinstance(value, str | int | float):
        return _problem(name, value, "is not a string or a number (quote it in YAML, e.g. '1' or 'true')",
                        secret=secret)
    return one_line(name, value, secret=secret)


def visible_devices(name: str, value: Any) -> str | None:
    """CUDA_VISIBLE_DEVICES: empty, or GPU indices / UUIDs separated by commas, each once."""
    text = "" if value is None else str(value)
    if text == "":
        return None
    ids = text.split(",")
    if len(ids) > 64 or not all(_GPU_ID.fullmatch(i) for i in ids):
        return _problem(name, value, "is not a list of GPUs: indices or GPU-/MIG- UUIDs separated by commas, "
                        "no spaces (e.g. 0 or 0,1)")
    seen = {i.lstrip("0") or "0" if i.isdigit() else i for i in ids}
    if len(seen) != len(ids):
        return _problem(name, value, "names a GPU twice: each visible device once (two ranks on one GPU "
                        "do not fit)")
    return None


def clients(name: str, value: Any) -> str | None:
    """IPAddressAllow= entries: addresses or CIDRs, or systemd's any/localhost/link-local/multicast."""
    if not isinstance(value, list) or len(value) > MAX_LIST_ITEMS:
        return _problem(name, value, "is not a list of addresses or CIDRs")
    for item in value:
        if item in ("any", "localhost", "link-local", "multicast"):
            continue
        try:
            ipaddress.ip_network(str(item), strict=False)
        except ValueError:
            return _problem(f"{name} entry", item, "is not an IP address or CIDR (e.g. 10.0.4.0/24), nor "
                            "any/localhost/link-local/multicast")
        if not isinstance(item, str) or not re.fullmatch(r"[0-9a-fA-F.:]+(/\d{1,3})?", item):
            return _problem(f"{name} entry", item, "is not written as an address or CIDR (e.g. 10.0.4.0/24)")
    return None


def listen_address(name: str, value: Any) -> str | None:
    if value == "localhost":
        return None
    try:
        ipaddress.ip_address(str(value))
    except ValueError:
        return _problem(name, value, "is not an IP address to listen on (e.g. 127.0.0.1, 0.0.0.0 or ::)")
    return None if isinstance(value, str) and "%" not in value else _problem(
        name, value, "is not an IP address to listen on (e.g. 127.0.0.1)")


def timespan(name: str, value: Any) -> str | None:
    if not isinstance(value, str) or not _TIMESPAN.fullmatch(value):
        return _problem(name, value, "is not a systemd time span like 30s, 15min or 1h")
    return None


def string_list(name: str, value: Any, *, limit: int = MAX_LIST_ITEMS) -> str | None:
    if not isinstance(value, list) or len(value) > limit:
        return _problem(name, value, f"is not a list (of at most {limit} strings)")
    for i, item in enumerate(value):
        if not isinstance(item, str | int | float) or isinstance(item, bool):
            return _problem(f"{name}[{i}]", item, "is not a string")
        bad = one_line(f"{name}[{i}]", item)
        if bad:
            return bad
    return None


# ---------------------------------------------------------------------------- launch flags


def flag_value(name: str, value: Any) -> str | None:
    """A profile flag's value (profiles.yml spelling): true (bare flag), false/null (left out), a number
    or one printable word."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return _problem(name, value, "is not a finite number")
    if isinstance(value, int | float):
        return None
    if not isinstance(value, str):
        return _problem(name, value, "is not a flag value: true/false, a number or a string")
    if value.strip().lower() in _BOOL_WORDS and not _NUMBER.fullmatch(value.strip()):
        return _problem(name, value, "is a boolean written as a string: write true or false without quotes "
                        "(a string renders as the flag's value)")
    if value == "":
        return _problem(name, value, "is empty: give a value, or null to leave the flag out")
    return one_line(name, value)


def profile_flags(name: str, flags: Any) -> list[str]:
    if not isinstance(flags, Mapping):
        return [_problem(name, flags, "is not a mapping of flag name -> value")]
    problems = []
    for key, value in flags.items():
        if not isinstance(key, str) or not _FLAG_NAME.fullmatch(key):
            problems.append(_problem(f"{name} key", key, "is not a flag name as SGLang spells it, without "
                                     "the leading '--' (e.g. mem-fraction-static)"))
            continue
        bad = flag_value(f"{name}.{key}", value)
        if bad:
            problems.append(bad)
    return problems


def split_launch_flags(items: Iterable[Any], name: str = "sglang_extra_flags") -> list[str]:
    """Argument words from a flag list as inventories write it: ``--flag``, ``--flag=value``,
    ``--flag value`` (one item, one space: how ``sglang_extra_flags`` spells them) or a value of its own
    item (taken whole: it may hold spaces). Raises InputError naming the item."""
    argv: list[str] = []
    items = list(items)
    if len(items) > MAX_LIST_ITEMS:
        raise InputError(_problem(name, f"{len(items)} items", f"is too long: at most {MAX_LIST_ITEMS}"))
    for i, item in enumerate(items):
        where = f"{name}[{i}]"
        if isinstance(item, bool) or not isinstance(item, str | int | float):
            raise InputError(_problem(where, item, "is not a string: write flags as '--name value'"))
        text = str(item)
        bad = one_line(where, text)
        if bad:
            raise InputError(bad)
        if text.startswith("--"):
            head, space, value = text.partition(" ")
            flag = head.partition("=")[0]
            if not _LONG_FLAG.fullmatch(flag):
                raise InputError(_problem(where, item, "is not a flag: --name (a-z, 0-9, '-'), then '=value' "
                                          "or ' value' (e.g. '--log-level info')"))
            if "=" in head or not space:  # --name or --name=value: one word, as written
                argv.append(text)
                continue
            if value == "" or value != value.strip() or " " in value:
                raise InputError(_problem(where, item, "is not one flag and one value ('--name value'): put "
                                          "a value with spaces in an item of its own after '--name'"))
            argv += [flag, value]
        elif text.startswith("-") and not _NUMBER.fullmatch(text):
            raise InputError(_problem(where, item, "is not a flag SGLang takes: long flags start with '--'"))
        elif text == "":
            raise InputError(_problem(where, item, "is empty"))
        else:
            if i == 0:
                raise InputError(_problem(where, item, "is a value with no flag before it: start with "
                                          "'--name'"))
            argv.append(text)
    return argv


def launch_problems(name: str, items: Any) -> list[str]:
    if not isinstance(items, list):
        return [_problem(name, items, "is not a list of flags (e.g. ['--log-level info'])")]
    try:
        split_launch_flags(items, name)
    except InputError as exc:
        return [str(exc)]
    return []


def flag_words(flags: Mapping[str, Any]) -> list[str]:
    """``--name`` / ``--name value`` words of a profile's flags (true: bare, false/null: left out)."""
    words: list[str] = []
    for key, value in flags.items():
        if value is None or value is False:
            continue
        words.append(f"--{key}")
        if value is not True:
            words.append(str(value))
    return words


# ---------------------------------------------------------------------------- systemd quoting


def systemd_word(word: Any) -> str:
    """One ExecStart= argument, as systemd will hand it to the program: double-quoted unless plain,
    backslash and quote escaped, '%' (specifiers) and '$' (environment) doubled."""
    text = str(word)
    bad = _bad_chars(text)
    if bad:
        raise InputError(f"{show(text)} holds the control character {bad}: it cannot go into a unit file")
    if not _PLAIN_WORD.fullmatch(text):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text.replace("%", "%%").replace("$", "$$")


def exec_line(argv: Iterable[Any], *, indent: str = "    ") -> str:
    """ExecStart='s value: each word quoted, one flag (with its value) per continued line."""
    words = [systemd_word(w) for w in argv]
    if not words:
        raise InputError("an empty command line")
    lines, current = [], [words[0]]
    for word in words[1:]:
        if word.startswith("--") and current:
            lines.append(" ".join(current))
            current = []
        current.append(word)
    lines.append(" ".join(current))
    return (" \\\n" + indent).join(lines)


def exec_words(argv: Iterable[Any]) -> str:
    """ExecStart='s value on one line: each word quoted."""
    return " ".join(systemd_word(w) for w in argv)


def env_file_value(value: Any) -> str:
    """A value for an EnvironmentFile= line: double-quoted, '"', '\\', '`' and '$' escaped (the only
    escapes systemd reads in double quotes), other text as UTF-8, never JSON's \\u escapes."""
    text = str(value)
    bad = _bad_chars(text)
    if bad:
        raise InputError(f"an environment value holds the control character {bad}: it cannot go into an "
                         "env file")
    return '"' + re.sub(r'(["\\`$])', r"\\\1", text) + '"'


def unit_value(name: str, value: Any) -> str:
    """A plain one-line directive value (User=, SyslogIdentifier=, ...): refused, never escaped."""
    bad = one_line(name, value, limit=1024)
    if bad:
        raise InputError(bad)
    return str(value)


# ---------------------------------------------------------------------------- the roles' checks


def _collect(*found: str | list[str] | None) -> list[str]:
    out: list[str] = []
    for item in found:
        if isinstance(item, list):
            out += item
        elif item:
            out.append(item)
    return out


def env_problems(name: str, env: Any, *, secret: bool = False) -> list[str]:
    if not isinstance(env, Mapping):
        return [_problem(name, "(not shown)" if secret else env, "is not a mapping NAME -> value")]
    problems = []
    for key, value in env.items():
        problems += _collect(env_name(f"{name} key", key),
                             env_value(f"{name}.{key}", value, secret=secret))
    return problems


def service_problems(v: Mapping[str, Any]) -> list[str]:
    """Every sglang_service value that reaches the unit, its env file, its flags or a path."""
    profile = v.get("profile_data") or {}
    problems = _collect(
        unit_name("sglang_service_unit_name", v.get("unit_name")),
        None if isinstance(v.get("profile"), str) and _UNIT_NAME.fullmatch(v["profile"]) else _problem(
            "sglang_service_profile", v.get("profile"), "is not a profile name"),
        one_line("the profile's description", profile.get("description", ""), limit=200),
        port("sglang_service_port", v.get("port"), zero_means="the profile's port"),
        port("the profile's port", profile.get("port")),
        None if v.get("effective_port") is None or port("", v.get("port"), zero_means="-") else port(
            "the service port (the profile's)", v.get("effective_port")),
        abs_path("sglang_service_release_dir", v.get("release_dir")) if v.get("release_dir") else None,
        abs_path("sglang_service_model_path", v.get("model_path"), plain=False),
        abs_path("sglang_service_draft_model_path", v.get("draft_model_path"), plain=False),
        *[abs_path(f"sglang_service_{d}", v.get(d)) for d in
          ("unit_dir", "env_dir", "state_dir", "rollback_dir")],
        strict_bool("sglang_service_enable_metrics", v.get("enable_metrics")),
        strict_bool("sglang_service_plan", v.get("plan")),
        profile_flags("sglang_service_flag_overrides", v.get("flag_overrides")),
        profile_flags("the profile's flags", profile.get("flags")),
        launch_problems("sglang_service_extra_flags", v.get("extra_flags")),
        env_problems("sglang_service_engine_env", v.get("engine_env")),
        env_problems("sglang_service_extra_env", v.get("extra_env")),
        env_problems("sglang_service_secret_env", v.get("secret_env"), secret=True),
        visible_devices("sglang_service_cuda_visible_devices", v.get("cuda_visible_devices")),
        account("sglang_service_user", v.get("user")),
        account("sglang_service_group", v.get("group")),
        integer("sglang_service_ready_timeout", v.get("ready_timeout"), 1, 86400),
        integer("sglang_service_start_timeout", v.get("start_timeout"), 1, 86400),
        integer("sglang_service_stop_timeout", v.get("stop_timeout"), 1, 86400),
        integer("sglang_service_stable_s", v.get("stable_s"), 0, 86400),
        integer("sglang_service_restart_sec", v.get("restart_sec"), 0, 86400),
        integer("sglang_service_start_limit_interval", v.get("start_limit_interval"), 1, 10**6),
        integer("sglang_service_start_limit_burst", v.get("start_limit_burst"), 1, 1000),
        clients("sglang_service_allowed_clients", v.get("allowed_clients")),
        string_list("sglang_service_device_allow", v.get("device_allow")),
        string_list("sglang_service_sandbox_disable", v.get("sandbox_disable")),
    )
    for entry in v.get("device_allow") or []:
        if isinstance(entry, str) and not _DEVICE_ALLOW.fullmatch(entry):
            problems.append(_problem("sglang_service_device_allow entry", entry,
                                     "is not a DeviceAllow= value: char-NAME, block-NAME or /dev/PATH, "
                                     "then r, w, m (e.g. 'char-nvidia rwm')"))
    sandbox = v.get("sandbox")
    if not isinstance(sandbox, Mapping):
        problems.append(_problem("sglang_service_sandbox", sandbox, "is not a mapping Directive -> value"))
    else:
        for key, value in sandbox.items():
            if not isinstance(key, str) or not _DIRECTIVE.fullmatch(key):
                problems.append(_problem("sglang_service_sandbox key", key, "is not a systemd directive name "
                                         "(e.g. ProtectSystem)"))
            elif bad := one_line(f"sglang_service_sandbox.{key}", value, limit=512):
                problems.append(bad)
    if not problems and as_int(v.get("start_timeout")) < as_int(v.get("ready_timeout")):  # type: ignore[operator]
        problems.append(_problem("sglang_service_start_timeout", v.get("start_timeout"),
                                 f"is below sglang_service_ready_timeout ({v.get('ready_timeout')}): systemd "
                                 "would stop the start before the readiness wait ends"))
    return problems


def service_argv(v: Mapping[str, Any]) -> list[str]:
    """The unit's ExecStart words: the engine, the models, the profile's flags, the host's, the address."""
    release = v["release_dir"]
    head = ([f"{release}/bin/ddtree", "lab", "serve"] if v["engine"] == "lab"
            else [f"{release}/bin/python", "-m", "sglang.launch_server"])
    argv = [*head, "--model-path", v["model_path"], "--speculative-algorithm", v["speculative_algorithm"],
            "--speculative-draft-model-path", v["draft_model_path"]]
    argv += flag_words(v["profile_data"]["flags"])
    argv += split_launch_flags(v.get("extra_flags") or [], "sglang_service_extra_flags")
    if as_bool(v["enable_metrics"]):
        argv.append("--enable-metrics")
    return [*argv, "--host", str(v["host"]), "--port", str(v["effective_port"])]


def service_env(v: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The env file's NAME=value pairs, in the file's order (later names win in systemd too)."""
    pairs: list[tuple[str, str]] = []
    if str(v.get("cuda_visible_devices") or "") != "":
        pairs.append(("CUDA_VISIBLE_DEVICES", str(v["cuda_visible_devices"])))
    extra = v.get("extra_env") or {}
    pairs += [(k, str(x)) for k, x in sorted((v.get("engine_env") or {}).items()) if k not in extra]
    pairs += [(k, str(x)) for k, x in sorted(extra.items())]
    pairs += [(k, str(x)) for k, x in sorted((v.get("secret_env") or {}).items())]
    return pairs


def canary_problems(v: Mapping[str, Any]) -> list[str]:
    problems = _collect(
        unit_name("sglang_canary_shadow_unit_name", v.get("shadow_unit_name")),
        unit_name("sglang_canary_live_unit_name", v.get("live_unit_name")),
        port("sglang_canary_shadow_port", v.get("shadow_port")),
        port("sglang_canary_live_port", v.get("live_port"), zero_means="the port live's state records"),
        integer("sglang_canary_rounds", v.get("rounds"), 1, 100),
        integer("sglang_canary_max_new_tokens", v.get("max_new_tokens"), 1, 4096),
        number("sglang_canary_min_accept_ratio", v.get("min_accept_ratio"), 0, 1.5, low_open=True),
        number("sglang_canary_max_latency_ratio", v.get("max_latency_ratio"), 0, 1000, low_open=True),
        number("sglang_canary_latency_slack_s", v.get("latency_slack_s"), 0, 3600),
        integer("sglang_canary_ready_timeout", v.get("ready_timeout"), 1, 86400),
        integer("sglang_canary_traffic_s", v.get("traffic_s"), 0, 86400),
        integer("sglang_canary_traffic_requests", v.get("traffic_requests"), 1, 10**6),
        number("sglang_canary_traffic_max_error_rate_increase",
               v.get("traffic_max_error_rate_increase"), 0, 1),
        strict_bool("sglang_canary_require_equal_tokens", v.get("require_equal_tokens")),
        string_list("sglang_canary_prompts", v.get("prompts"), limit=64),
        launch_problems("sglang_canary_shadow_extra_flags", v.get("shadow_extra_flags")),
        env_problems("sglang_canary_shadow_extra_env", v.get("shadow_extra_env")),
        visible_devices("sglang_canary_shadow_cuda_visible_devices", v.get("shadow_cuda_visible_devices")),
        *[abs_path(f"sglang_canary_{d}", v.get(d)) for d in
          ("report_dir", "unit_dir", "env_dir", "state_dir", "rollback_dir")],
    )
    if v.get("release_dir"):
        problems += _collect(abs_path("sglang_canary_release_dir", v.get("release_dir")))
    if not problems and v.get("shadow_unit_name") == v.get("live_unit_name"):
        problems.append(_problem("sglang_canary_shadow_unit_name", v.get("shadow_unit_name"),
                                 "is the live unit's name: the shadow runs beside live, under its own name"))
    return problems


def recorded_state_problems(name: str, state: Any, releases_dir: str) -> list[str]:
    """A deployed-state file (<unit>.json) read back from a host before its values steer paths."""
    if not isinstance(state, Mapping):
        return [_problem(name, state, "is not a JSON object (the service role writes one)")]
    problems = []
    for key in ("release", "previous_release"):
        if state.get(key) is not None:
            problems += _collect(release_id(f"{name} {key}", state.get(key)))
    release_dir = state.get("release_dir")
    if release_dir is not None:
        bad = abs_path(f"{name} release_dir", release_dir)
        if bad is None and posixpath.dirname(release_dir) != releases_dir:
            bad = _problem(f"{name} release_dir", release_dir, f"is not a release under {releases_dir}")
        problems += _collect(bad)
    if state.get("port") is not None:
        problems += _collect(port(f"{name} port", state.get("port")))
    if state.get("profile") is not None and not (isinstance(state["profile"], str)
                                                  and _UNIT_NAME.fullmatch(state["profile"])):
        problems.append(_problem(f"{name} profile", state.get("profile"), "is not a profile name"))
    return problems


def exporter_problems(v: Mapping[str, Any]) -> list[str]:
    problems = _collect(
        port("ddtree_exporter_port", v.get("port")),
        listen_address("ddtree_exporter_listen_address", v.get("listen_address")),
        clients("ddtree_exporter_allowed_clients", v.get("allowed_clients")),
        abs_path("ddtree_exporter_state_dir", v.get("state_dir")),
        abs_path("ddtree_exporter_unit_dir", v.get("unit_dir")),
        abs_path("ddtree_exporter_probe_env_dir", v.get("probe_env_dir")),
        abs_path("ddtree_exporter_release_dir", v.get("release_dir")) if v.get("release_dir") else None,
        unit_name("ddtree_exporter_state_unit", v.get("state_unit")),
        account("ddtree_exporter_user", v.get("user")),
        account("ddtree_exporter_probe_user", v.get("probe_user")),
        timespan("ddtree_exporter_probe_interval", v.get("probe_interval")),
        number("ddtree_exporter_probe_min_accept_length", v.get("probe_min_accept_length"), 1.0, 1000),
        strict_bool("ddtree_exporter_probe_allow_lossless_unchecked",
                    v.get("probe_allow_lossless_unchecked", False)),
        integer("ddtree_exporter_probe_timeout", v.get("probe_timeout"), 1, 86400),
        integer("ddtree_exporter_probe_request_timeout", v.get("probe_request_timeout"), 1, 86400),
    )
    units = v.get("probe_units")
    if not isinstance(units, list) or len(units) > 64:
        problems.append(_problem("ddtree_exporter_probe_units", units, "is not a list of {unit, port}"))
    else:
        for i, entry in enumerate(units):
            if not isinstance(entry, Mapping):
                problems.append(_problem(f"ddtree_exporter_probe_units[{i}]", entry, "is not {unit, port}"))
                continue
            problems += _collect(unit_name(f"ddtree_exporter_probe_units[{i}].unit", entry.get("unit")),
                                 port(f"ddtree_exporter_probe_units[{i}].port", entry.get("port")))
    if not problems and v.get("user") == v.get("probe_user"):
        problems.append(_problem("ddtree_exporter_probe_user", v.get("probe_user"),
                                 "is the exporter's user: the probe runs as a user of its own"))
    return problems


def probe_problems(v: Mapping[str, Any]) -> list[str]:
    url = v.get("url")
    bad_url = None
    if not isinstance(url, str) or not _URL.fullmatch(url):
        bad_url = _problem("ddtree_probe_url", url, "is not an http(s) URL to the server (e.g. "
                           "http://127.0.0.1:30000)")
    problems = _collect(
        bad_url,
        unit_name("ddtree_probe_unit_name", v.get("unit_name")),
        abs_path("ddtree_probe_model_path", v.get("model_path"), plain=False),
        abs_path("ddtree_probe_draft_model_path", v.get("draft_model_path"), plain=False),
        abs_path("ddtree_probe_report_dir", v.get("report_dir")),
        number("ddtree_probe_min_accept_length", v.get("min_accept_length"), 1.0, 1000),
        strict_bool("ddtree_probe_allow_lossless_unchecked", v.get("allow_lossless_unchecked", False)),
        integer("ddtree_probe_timeout", v.get("timeout"), 1, 86400),
    )
    since = v.get("journal_since")
    if since not in (None, "") and integer("ddtree_probe_journal_since", since, 0, 10**11):
        problems.append(_problem("ddtree_probe_journal_since", since, "is not epoch seconds (or empty)"))
    expect = v.get("expect")
    if not isinstance(expect, Mapping):
        problems.append(_problem("ddtree_probe_expect", expect, "is not a mapping"))
    else:
        for key, value in expect.items():
            problems += _collect(None if isinstance(key, str) and re.fullmatch(r"[a-z0-9_]{1,64}", key) else
                                 _problem("ddtree_probe_expect key", key, "is not a server_info field name"),
                                 one_line(f"ddtree_probe_expect.{key}", value, limit=256))
    return problems


def runtime_problems(v: Mapping[str, Any]) -> list[str]:
    problems = _collect(
        *[abs_path(f"ddtree_runtime_{d}", v.get(d)) for d in ("root", "python", "wheelhouse", "models_dir")],
        integer("ddtree_runtime_keep_releases", v.get("keep_releases"), 1, 100),
        strict_bool("ddtree_runtime_plugin_check", v.get("plugin_check")),
        strict_bool("ddtree_runtime_lab_cpu_compat", v.get("lab_cpu_compat")),
        strict_bool("ddtree_runtime_make_lab_models", v.get("make_lab_models")),
        string_list("ddtree_runtime_pip_index_args", v.get("pip_index_args")),
        string_list("ddtree_runtime_packages", v.get("packages")),
        string_list("ddtree_runtime_nodeps_packages", v.get("nodeps_packages")),
        string_list("ddtree_runtime_reference_paths", v.get("reference_paths")),
    )
    for key in ("packages", "nodeps_packages"):
        for item in v.get(key) or []:
            if isinstance(item, str) and (item.startswith("-") or not _REQUIREMENT.fullmatch(item)):
                problems.append(_problem(f"ddtree_runtime_{key} entry", item, "is not a pinned requirement "
                                         "(name==version, no spaces, not a pip option)"))
    for path in v.get("reference_paths") or []:
        problems += _collect(abs_path("ddtree_runtime_reference_paths entry", path))
    return problems


_ROUTER_VERSION = re.compile(r"\d{1,4}\.\d{1,4}\.\d{1,4}")
# 16+ characters the router's id:name:role:key list and an HTTP bearer header both carry as they are.
_CONTROL_KEY = re.compile(r"[A-Za-z0-9_.~+/=-]{16,256}")
# Every long option of the pinned router's parser (sglang_router.launch_router.parse_router_args, an
# argparse parser with allow_abbrev: any unambiguous prefix of one of these is that option).
# tests/unit/test_router_role.py reads the installed router's own parser and keeps this equal.
_ROUTER_0_3_2_OPTIONS = """
        --host --port --worker-urls --policy --prefill-policy --decode-policy --cache-threshold
        --balance-abs-threshold --balance-rel-threshold --bucket-adjust-interval-secs --eviction-interval-secs
        --max-tree-size --max-idle-secs --assignment-mode --max-payload-size --dp-aware --enable-igw --mini-lb
        --pd-disaggregation --prefill --decode --worker-startup-timeout-secs --worker-startup-check-interval
        --log-dir --log-level --service-discovery --selector --service-discovery-port
        --service-discovery-namespace --prefill-selector --decode-selector --prometheus-port --prometheus-host
        --prometheus-duration-buckets --request-id-headers --request-timeout-secs --shutdown-grace-period-secs
        --cors-allowed-origins --max-concurrent-requests --queue-size --queue-timeout-secs
        --rate-limit-tokens-per-second --retry-max-retries --retry-initial-backoff-ms --retry-max-backoff-ms
        --retry-backoff-multiplier --retry-jitter-factor --disable-retries --cb-failure-threshold
        --cb-success-threshold --cb-timeout-duration-secs --cb-window-duration-secs --disable-circuit-breaker
        --health-failure-threshold --health-success-threshold --health-check-timeout-secs
        --health-check-interval-secs --health-check-endpoint --disable-health-check --model-path
        --tokenizer-path --chat-template --tokenizer-cache-enable-l0 --tokenizer-cache-l0-max-entries
        --tokenizer-cache-enable-l1 --tokenizer-cache-l1-max-memory --reasoning-parser --tool-call-parser
        --mcp-config-path --backend --history-backend --oracle-wallet-path --oracle-tns-alias
        --oracle-connect-descriptor --oracle-username --oracle-password --oracle-pool-min --oracle-pool-max
        --oracle-pool-timeout-secs --postgres-db-url --postgres-pool-max --redis-url --redis-pool-max
        --redis-retention-days --client-cert-path --client-key-path --ca-cert-paths --tls-cert-path
        --tls-key-path --enable-trace --otlp-traces-endpoint --api-key --control-plane-api-keys
        --control-plane-audit-enabled --jwt-issuer --jwt-audience --jwt-jwks-uri --jwt-role-mapping
        --help"""
ROUTER_OPTIONS: dict[str, frozenset[str]] = {"0.3.2": frozenset(_ROUTER_0_3_2_OPTIONS.split())}
# What extra flags may never set, besides every flag router_argv renders: the launcher's own (the
# worker list and the control key, from the unit's environment), secrets (a unit and a command line are
# readable by every local user), and what turns off what the rotation relies on or exits the router.
ROUTER_LAUNCHER_FLAGS = ("--worker-urls", "--control-plane-api-keys")
ROUTER_SECRET_FLAGS = ("--api-key", "--oracle-password", "--postgres-db-url", "--redis-url")
ROUTER_MODE_FLAGS = ("--help", "--disable-health-check", "--mini-lb", "--pd-disaggregation",
                     "--service-discovery", "--enable-igw", "--tls-cert-path", "--tls-key-path",
                     "--health-check-endpoint")


def resolve_router_option(word: str, version: str) -> tuple[str | None, str | None]:
    """(the option the pinned router's argparse reads `word` as, None) or (None, why it reads none):
    an exact name, else the one option it is a prefix of; `--name=value` counts by its name."""
    options = ROUTER_OPTIONS.get(version)
    if options is None:
        known = ", ".join(sorted(ROUTER_OPTIONS))
        return None, (f"cannot be checked: the flag table knows sglang-router {known} only, not "
                      f"{version} (add its options to deploy_inputs.ROUTER_OPTIONS)")
    name = word.partition("=")[0]
    if name in options:
        return name, None
    matches = sorted(o for o in options if o.startswith(name))
    if len(matches) == 1:
        return matches[0], None
    if matches:
        shown = ", ".join(matches[:6])
        return None, f"is ambiguous to sglang-router {version} ({shown}...): it would not start"
    return None, f"is not an option of sglang-router {version}: it would not start"


# The role installs roles/sglang_router/files/ddtree-router-launch.py under sglang_router_root.
ROUTER_LAUNCHER = "ddtree-router-launch.py"


def router_argv(v: Mapping[str, Any]) -> list[str]:
    """The router unit's ExecStart words (the launcher, then every flag the role sets). The worker list
    and the control key are not here: the launcher reads them from the unit's environment."""
    venv = f"{v['root']}/{v['version']}"
    argv = [f"{venv}/bin/python", "-I", f"{v['root']}/{ROUTER_LAUNCHER}",
            "--host", str(v["listen_address"]), "--port", str(v["port"]), "--policy", str(v["policy"]),
            "--prometheus-host", str(v["metrics_listen_address"]),
            "--prometheus-port", str(v["metrics_port"]),
            "--health-check-interval-secs", str(v["health_check_interval_s"]),
            "--health-failure-threshold", str(v["health_failure_threshold"]),
            "--request-timeout-secs", str(v["request_timeout_s"]),
            "--shutdown-grace-period-secs", str(v["shutdown_grace_s"]),
            "--worker-startup-timeout-secs", str(v["worker_startup_timeout_s"])]
    return argv + split_launch_flags(v.get("extra_flags") or [], "sglang_router_extra_flags")


def router_flag_problems(v: Mapping[str, Any]) -> list[str]:
    """Extra router flags read as the pinned router's parser reads them (prefixes too), refused when one
    names a flag the role's unit sets, a secret, or a mode the rotation cannot work with."""
    items = v.get("extra_flags")
    if not isinstance(items, list) or launch_problems("sglang_router_extra_flags", items):
        return []  # said by launch_problems
    version = str(v.get("version"))
    try:
        owned = {w for w in router_argv({**v, "extra_flags": []}) if w.startswith("--")}
    except (KeyError, InputError):
        owned = set()
    owned |= set(ROUTER_LAUNCHER_FLAGS)
    problems = []
    # Only the flag's name is shown: its value may be a secret.
    for i, item in enumerate(items):
        text = str(item)
        if not text.startswith("--"):
            continue  # a value of its own item
        name = text.partition(" ")[0].partition("=")[0]
        where = f"sglang_router_extra_flags[{i}]"
        option, why = resolve_router_option(name, version)
        if option is None:
            problems.append(_problem(where, name, str(why)))
        elif option in ROUTER_SECRET_FLAGS:
            problems.append(_problem(where, name, f"is {option}, a secret: the unit and the router's command "
                                     "line are readable by every local user, so it is not supported here"))
        elif option in owned:
            owned_list = ", ".join(sorted(owned))
            problems.append(_problem(where, name, f"is read as {option} by sglang-router {version}, which "
                                     f"the role sets itself: {owned_list} may not be given here"))
        elif option in ROUTER_MODE_FLAGS:
            problems.append(_problem(where, name, f"is read as {option}: the role and the rotation need the "
                                     "router's plain-HTTP control API and its health checks as they are"))
    return problems


def ip_address(name: str, value: Any) -> str | None:
    """A literal IPv4 or IPv6 address (a unit's address filter and a worker URL take no names)."""
    try:
        ipaddress.ip_address(value if isinstance(value, str) else "-")
    except ValueError:
        return _problem(name, value, "is not an IP address (e.g. 10.0.4.11): a worker's is its "
                        "sglang_rotation_worker_address, else its ansible_host")
    return None


def router_problems(v: Mapping[str, Any]) -> list[str]:
    """Every sglang_router value that reaches its unit, its env file, its venv's path or pip."""
    problems = _collect(
        None if isinstance(v.get("version"), str) and _ROUTER_VERSION.fullmatch(v["version"]) else _problem(
            "sglang_router_version", v.get("version"), "is not a release like 0.3.2"),
        None if v.get("install_source") in ("index", "wheelhouse") else _problem(
            "sglang_router_install_source", v.get("install_source"), "is not index or wheelhouse"),
        *[abs_path(f"sglang_router_{d}", v.get(d)) for d in
          ("wheelhouse", "root", "python", "unit_dir", "env_dir", "state_dir")],
        string_list("sglang_router_pip_index_args", v.get("pip_index_args")),
        listen_address("sglang_router_listen_address", v.get("listen_address")),
        listen_address("sglang_router_metrics_listen_address", v.get("metrics_listen_address")),
        port("sglang_router_port", v.get("port")),
        port("sglang_router_metrics_port", v.get("metrics_port")),
        clients("sglang_router_allowed_clients", v.get("allowed_clients")),
        None if v.get("policy") in ("cache_aware", "round_robin", "random", "power_of_two") else _problem(
            "sglang_router_policy", v.get("policy"),
            "is not cache_aware, round_robin, random or power_of_two"),
        integer("sglang_router_health_check_interval_s", v.get("health_check_interval_s"), 1, 3600),
        integer("sglang_router_health_failure_threshold", v.get("health_failure_threshold"), 1, 1000),
        integer("sglang_router_request_timeout_s", v.get("request_timeout_s"), 1, 86400),
        integer("sglang_router_shutdown_grace_s", v.get("shutdown_grace_s"), 0, 86400),
        integer("sglang_router_worker_startup_timeout_s", v.get("worker_startup_timeout_s"), 1, 86400),
        launch_problems("sglang_router_extra_flags", v.get("extra_flags")),
        account("sglang_router_user", v.get("user")),
        string_list("sglang_router_workers", v.get("workers")),
    )
    key = v.get("control_key")
    if not isinstance(key, str) or (key != "" and not _CONTROL_KEY.fullmatch(key)):
        problems.append(_problem("sglang_router_control_key", key, "is not 16-256 characters of A-Z a-z 0-9 "
                                 "and -_.~+/= (or empty on a loopback router)", secret=True))
    if not problems and as_int(v.get("port")) == as_int(v.get("metrics_port")):
        problems.append(_problem("sglang_router_metrics_port", v.get("metrics_port"),
                                 "is the router's port: the metrics listen on a port of their own"))
    problems += router_flag_problems(v)
    addresses = v.get("worker_addresses")
    for i, address in enumerate(addresses if isinstance(addresses, list) else [addresses]):
        problems += _collect(ip_address(f"sglang_router_workers[{i}]'s address", address))
    return problems


def rotation_problems(v: Mapping[str, Any]) -> list[str]:
    """The sglang_rotation values that reach a router's control API, a URL or a wait."""
    return _collect(
        strict_bool("sglang_rotation_enabled", v.get("enabled")),
        strict_bool("sglang_rotation_allow_single_host_downtime", v.get("allow_single_host_downtime")),
        ip_address("sglang_rotation_worker_address", v.get("worker_address")),
        ip_address("sglang_rotation_local_address", v.get("local_address")),
        port("sglang_rotation_port", v.get("port")),
        port("sglang_rotation_shadow_port", v.get("shadow_port")),
        unit_name("sglang_rotation_unit", v.get("unit")),
        abs_path("sglang_rotation_state_dir", v.get("state_dir")),
        integer("sglang_rotation_drain_timeout", v.get("drain_timeout"), 0, 86400),
        integer("sglang_rotation_join_timeout", v.get("join_timeout"), 1, 86400),
        integer("sglang_rotation_api_timeout", v.get("api_timeout"), 1, 3600),
        string_list("sglang_rotation_routers", v.get("routers")),
    )


# ---------------------------------------------------------------------------- what a router says

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
        raise InputError(_problem(name, url, "is not a URL string (1-2048 characters)"))
    if _bad_chars(url) or any(ch.isspace() for ch in url):
        raise InputError(_problem(name, url, "holds a space or a control character"))
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        return None
    if "@" in parts.netloc:
        raise InputError(_problem(name, url, "holds credentials (user:pass@)", secret=True))
    if parts.query or parts.fragment or "?" in url or "#" in url or "%" in parts.netloc:
        raise InputError(_problem(name, url, "holds a query, a fragment or an escape: not a worker URL"))
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        raise InputError(_problem(name, url, "has no valid port (1-65535)")) from None
    host = (parts.hostname or "").lower()
    try:
        address = ipaddress.ip_address(host)
        host = f"[{address.compressed}]" if address.version == 6 else address.compressed
    except ValueError:
        if not _HOST_NAME.fullmatch(host) or len(host) > 253:
            raise InputError(_problem(name, url, "has no valid host (an IP address or a DNS name)")) from None
    path = parts.path.rstrip("/")
    if not _URL_PATH.fullmatch(path):
        raise InputError(_problem(name, url, "has a path a worker URL does not have"))
    return f"{scheme}://{host}:{port}{path}"


def router_workers(answer: Any, router: str) -> list[dict[str, Any]]:
    """A router's GET /workers answer ({"workers": [...]} or the list) as [{id, url, is_healthy}]: each id
    checked before it goes into a path, each URL in worker_url's spelling, health a JSON boolean (not a
    truthy string). Workers of another scheme are left out (they serve no http traffic of ours). Anything
    else is InputError, one line naming the router and the entry: a decision makes no change on it. The
    result is itself such an answer (checking it again gives it back)."""
    listing = answer.get("workers") if isinstance(answer, Mapping) else answer
    if not isinstance(listing, list):
        raise InputError(f"router {router}: its GET /workers answer {show(answer)} is not a worker list")
    if len(listing) > MAX_WORKERS:
        raise InputError(f"router {router}: lists {len(listing)} workers, more than {MAX_WORKERS}")
    workers = []
    for i, entry in enumerate(listing):
        where = f"router {router} worker {i}"
        if not isinstance(entry, Mapping):
            raise InputError(_problem(where, entry, "is not an object {id, url, is_healthy}"))
        wid, healthy = entry.get("id"), entry.get("is_healthy")
        if not isinstance(wid, str) or not _WORKER_ID.fullmatch(wid):
            raise InputError(_problem(f"{where} id", wid, "is not a worker id: 1-128 of letters, digits and "
                                      "'_.-', starting with a letter or digit"))
        if not isinstance(healthy, bool):
            raise InputError(_problem(f"{where} is_healthy", healthy, "is not a JSON boolean"))
        url = worker_url(entry.get("url"), f"{where} url")
        if url is not None:
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
