"""A disk cache for artefacts derived from a model file (converted tokenizer, dequantized GGUF weights).

Converting SmolLM2's GGUF (tokenizer through transformers, weights through `gguf`) costs tens of seconds;
every later start of a server or engine reads the converted copy in about a second.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from typing import Callable


def cache_root() -> str:
    return os.environ.get("BRAID_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "braid"))


def cached_dir(source_path: str, kind: str, build: Callable[[str], None]) -> str:
    """The folder for (source file, kind); `build(tmp_dir)` fills it the first time (atomically renamed into place)."""
    st = os.stat(source_path)
    key = hashlib.sha256(f"{os.path.abspath(source_path)}|{st.st_size}|{st.st_mtime_ns}|{kind}|v1".encode()).hexdigest()[:20]
    final = os.path.join(cache_root(), kind, key)
    if os.path.isdir(final):
        return final
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(final), prefix=".tmp-")
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
