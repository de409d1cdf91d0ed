"""systemd's own quoting for what passes the rules: ExecStart= words (systemd.service(5) "Command lines"),
EnvironmentFile= values (systemd.exec(7)) and plain directive values (systemd.syntax(7))."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from .values import InputError, bad_chars, one_line, show

# A word ExecStart= may carry as it is: anything else is double-quoted.
_PLAIN_WORD = re.compile(r"[A-Za-z0-9_./:=,+@\[\]-]+")


def systemd_word(word: Any) -> str:
    """One ExecStart= argument, as systemd will hand it to the program: double-quoted unless plain,
    backslash and quote escaped, '%' (specifiers) and '$' (environment) doubled."""
    text = str(word)
    bad = bad_chars(text)
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
    bad = bad_chars(text)
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
