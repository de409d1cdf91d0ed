"""The one way a health tool writes its JSON (probe report, canary report, metrics state).

Strict JSON (NaN and infinities refused: Prometheus and `jq` readers would choke on them), written to a
temp file beside the target and renamed over it, so a reader never sees half a report and a failed write
leaves neither a half file nor a stray temp file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomic(doc: dict[str, Any], path: str | Path) -> None:
    """Write ``doc`` to ``path`` (parents made, mode 0644); ValueError for a non-finite number."""
    target = Path(path)
    text = json.dumps(doc, indent=2, allow_nan=False)  # before anything is created
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
