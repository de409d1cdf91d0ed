"""systemd's own parsers, run on rendered files: what a unit's ExecStart= and an env file really say.

- ``exec_start(unit)``: ``systemd-analyze verify`` at debug level dumps the unit as systemd loaded it;
  its ``Command Line:`` is the argv systemd will exec (printed with systemd's shell quoting, read back
  here), before the exec-time ``$`` substitution, which :func:`exec_time_argv` applies.
- ``env_file(path)``: systemd's environment.d generator reads the file with the same tokenizer
  ``EnvironmentFile=`` uses (src/basic/env-file.c, parse_env_file_internal) and prints the values. The
  generator then expands ``$NAME`` from its own environment, which EnvironmentFile= does not: each
  ``$NAME`` of the expected values is given to it as itself, so the expansion changes nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ANALYZE = shutil.which("systemd-analyze")
ENV_GENERATOR = next(
    (
        p
        for p in (
            "/usr/lib/systemd/user-environment-generators/30-systemd-environment-d-generator",
            "/lib/systemd/user-environment-generators/30-systemd-environment-d-generator",
        )
        if os.access(p, os.X_OK)
    ),
    None,
)


def _unquote_words(text: str) -> list[str]:
    """Words as systemd's shell_maybe_quote() prints them: bare, or "..." with \\ before " \\ ` $."""
    words, i = [], 0
    while i < len(text):
        if text[i] == " ":
            i += 1
            continue
        if text[i] == '"':
            i += 1
            word = []
            while text[i] != '"':
                if text[i] == "\\":
                    i += 1
                word.append(text[i])
                i += 1
            i += 1
            words.append("".join(word))
        else:
            end = text.find(" ", i)
            end = len(text) if end < 0 else end
            words.append(text[i:end])
            i = end
    return words


def verify(unit: Path) -> tuple[int, str, str]:
    """rc, the warnings (normal level) and the debug dump of ``systemd-analyze verify``."""
    plain = subprocess.run([ANALYZE, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    debug = subprocess.run(
        [ANALYZE, "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "debug"},
    )
    return plain.returncode, (plain.stdout + plain.stderr).strip(), debug.stdout + debug.stderr


def exec_start(unit: Path) -> list[str]:
    """The argv of the unit's one ExecStart=, as loaded by systemd."""
    _, _, dump = verify(unit)
    section = dump.split(f"-> Unit {unit.name}:", 1)[1]
    (line,) = re.findall(r"-> ExecStart:\n\s*Command Line: (.*)", section)
    return _unquote_words(line)


def exec_time_argv(argv: list[str]) -> list[str]:
    """What the program receives: systemd turns '$$' into '$' at exec time; a lone '$NAME' would be
    substituted, which a correctly quoted unit never holds."""
    for word in argv:
        assert "$" not in word.replace("$$", ""), f"a lone $ in {word!r}: systemd would substitute it"
    return [w.replace("$$", "$") for w in argv]


def env_file(path: Path, *, dollar_names: tuple[str, ...] = ()) -> dict[str, str]:
    """NAME -> value of an env file as systemd reads it."""
    with_dir = path.parent / "systemd-parse" / "environment.d"
    with_dir.mkdir(parents=True, exist_ok=True)
    (with_dir / "90-test.conf").write_bytes(path.read_bytes())
    env = {"XDG_CONFIG_HOME": str(with_dir.parent), "PATH": os.environ.get("PATH", "/usr/bin")}
    env.update({name: f"${name}" for name in dollar_names})
    out = subprocess.run([ENV_GENERATOR], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "invalid syntax" not in out.stderr, out.stderr
    values = {}
    for line in out.stdout.splitlines():
        name, _, value = line.partition("=")
        values[name] = _unquote_words(value)[0] if value.startswith('"') else value
    return values
