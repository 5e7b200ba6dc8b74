"""GCS: an object copied by the store itself, pinned to the generation listed."""

from __future__ import annotations

from typing import Any

from fsspec.asyn import sync

from .errors import storage_errors

__all__ = ["copy_object"]


def copy_object(fs: Any, source: str, generation: str, path: str) -> None:
    """``source`` at ``generation`` (GCS refuses another) rewritten to ``path``; GCS keeps the copy's CRC32C."""
    b1, k1, _ = fs.split_path(source)
    b2, k2, _ = fs.split_path(path)

    async def rewrite() -> None:
        token: dict[str, str] = {}
        while True:
            out = await fs._call(
                "POST",
                "b/{}/o/{}/rewriteTo/b/{}/o/{}",
                b1,
                k1,
                b2,
                k2,
                headers={"Content-Type": "application/json"},
                json_out=True,
                sourceGeneration=generation,
                **token,
            )
            if out.get("done") is True:
                return
            token = {"rewriteToken": out["rewriteToken"]}

    with storage_errors(f"copying {fs.unstrip_protocol(source)}"):
        sync(fs.loop, rewrite)
    fs.invalidate_cache(path)
