"""Real images for tests that send image parts: small, valid files of any pixel size."""

from __future__ import annotations

import base64
import struct
import zlib


def png(width: int, height: int) -> bytes:
    """A valid greyscale PNG of ``width`` × ``height`` black pixels.

    Real rather than a bare header, so whatever reads it (the proxy's pricing, a backend)
    sees what a client would send; all-black rows compress to almost nothing, so a
    1024 × 1024 image is about a kilobyte.
    """

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit grey, no interlace
    rows = (b"\x00" + bytes(width)) * height  # filter byte 0, then the row's pixels
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows, 9))
        + chunk(b"IEND", b"")
    )


def png_part(width: int, height: int, detail: str | None = None) -> dict:
    """A chat content part carrying a PNG inline, as a ``data:`` URL."""
    url = "data:image/png;base64," + base64.b64encode(png(width, height)).decode()
    image = {"url": url} if detail is None else {"url": url, "detail": detail}
    return {"type": "image_url", "image_url": image}
