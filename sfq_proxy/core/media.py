"""What a chat message's non-text content parts cost (issue 16): images, audio, files, video.

Only text used to be priced, so a tenant could send a 200 KB image for the price of its
caption. Each non-text part is now a :class:`Media`: its kind, and its token count when the
part itself tells us (an image whose size can be read from its own header); otherwise the
pool's configured price for the kind applies.

Sans-I/O like the rest of ``core``: nothing is fetched (an ``https://`` image is never
downloaded, so its size is unknown), and only a bounded prefix of an inline ``data:`` URL is
ever decoded, so a 50 MB upload costs the proxy no more to price than a 50 KB one.

The rule "never free" runs through the module: a part is free only when it is text and
carries no media field at all; anything unrecognised is priced as a file, and anything that
cannot be read is priced at the pool's configured price, never at zero.
"""

from __future__ import annotations

import binascii
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

Kind = Literal["image", "audio", "file", "video"]


@dataclass(frozen=True, slots=True)
class Media:
    kind: Kind
    # known from the part itself (an image whose size can be read), else None: the pool's
    # configured price for `kind` applies
    tokens: int | None


# -- which parts are media --------------------------------------------------------------------

# Text-like part types: their text is priced with the message's text, not here. "refusal"
# (OpenAI's assistant messages), "input_text"/"output_text" (the Responses API), "thinking"
# and "tool_reference" (vLLM). The text of the last three is not under "text" but under
# "refusal", "thinking" and "name": the caller reads every string of such a part but its
# MEDIA_FIELDS (core/inference_request.py).
TEXT_TYPES = frozenset(
    {"text", "input_text", "output_text", "refusal", "thinking", "tool_reference"}
)

# Every media part type OpenAI documents or vLLM accepts (vllm/entrypoints/chat_utils.py,
# MM_PARSER_MAP), and what it is priced as. Any other type is a file.
_TYPE_KINDS: dict[str, Kind] = {
    "image_url": "image",
    "input_image": "image",  # the Responses API's shape: image_url is a string
    "image_pil": "image",
    "image_embeds": "image",
    "input_audio": "audio",
    "audio_url": "audio",
    "audio_embeds": "audio",
    "video_url": "video",
    "file": "file",
    "input_file": "file",
    "prompt_embeds": "file",  # raw embeddings: their length is not readable cheaply
}

# vLLM also takes a part with no "type" (or with a "uuid", whatever its type) by the media
# field it carries, in this order; such a part must not pass for free text.
_FIELD_KINDS: tuple[tuple[str, Kind], ...] = (
    ("image_url", "image"),
    ("image_pil", "image"),
    ("image_embeds", "image"),
    ("audio_embeds", "audio"),
    ("prompt_embeds", "file"),
    ("audio_url", "audio"),
    ("input_audio", "audio"),
    ("video_url", "video"),
)

# The fields that carry a part's media (for most types, the field named as the type): their
# strings are data, URLs and ids, priced here as media and never read as text.
MEDIA_FIELDS = frozenset({*_TYPE_KINDS, *(field for field, _ in _FIELD_KINDS)})


def media_part(part: Mapping[str, Any]) -> Media | None:
    """None for a text part ({"type": "text", ...} or a part with no "type"); otherwise the
    Media it is priced as. A part of an unknown type is a "file" (priced, never free).

    Any JSON value is accepted and nothing raises: the request's own validation, not its
    pricing, decides what is malformed. A bare string is text (vLLM accepts it as such);
    any other non-object is of no known type, so a file. A text or typeless part that
    carries a media field (``image_url``, ``video_url``...) is priced as that media, since
    vLLM reads such a part (with a ``uuid``, or without a type) as media.
    """
    if isinstance(part, str):
        return None
    if not isinstance(part, Mapping):
        return Media("file", None)
    kind = part.get("type")
    if kind is None or (isinstance(kind, str) and kind in TEXT_TYPES):
        return _by_field(part)
    if not isinstance(kind, str) or kind not in _TYPE_KINDS:
        return Media("file", None)
    if _TYPE_KINDS[kind] == "image":
        return _image(part)
    return Media(_TYPE_KINDS[kind], None)


def _by_field(part: Mapping[str, Any]) -> Media | None:
    """A text or typeless part: the media its fields make it, or None when it has none."""
    for field, kind in _FIELD_KINDS:
        if field in part:
            return _image(part) if kind == "image" else Media(kind, None)
    return None


def _image(part: Mapping[str, Any]) -> Media:
    """An image part, priced by its size when an inline URL's header gives it.

    The URL and ``detail`` are read from the ``image_url`` object (Chat Completions); when
    ``image_url`` is a bare string there is nowhere inside it for a ``detail``, so the part's
    own ``detail`` counts (where the Responses API's ``input_image`` puts it). A ``detail``
    that is not a string is ignored, so priced as high.
    """
    source = part.get("image_url")
    if isinstance(source, Mapping):
        url, detail = source.get("url"), source.get("detail")
    else:
        url, detail = source, part.get("detail")
    detail = detail if isinstance(detail, str) else "auto"
    size = image_size(url) if isinstance(url, str) else None
    if size is not None:
        return Media("image", image_tokens(*size, detail))
    if detail == "low":  # low detail is a flat price whatever the size
        return Media("image", LOW_DETAIL_TOKENS)
    return Media("image", None)


# -- what an image costs ----------------------------------------------------------------------

LOW_DETAIL_TOKENS = 85  # also the base every high-detail image pays
TILE_TOKENS = 170
TILE = 512
FIT = 2048
SHORT_SIDE = 768
# the most a high-detail image can cost: 2 × 4 tiles (768 × 2048 after scaling)
MAX_IMAGE_TOKENS = LOW_DETAIL_TOKENS + TILE_TOKENS * 8


def image_tokens(width: int, height: int, detail: str) -> int:
    """OpenAI's published price of an image (gpt-4o / gpt-4.1 family; the vision guide's
    "Calculating costs"). ``detail: "low"`` is a flat 85 tokens whatever the size. Anything
    else ("high", "auto", or a value OpenAI would reject) is priced as high, the
    conservative reading: scale down to fit within 2048 × 2048 keeping the aspect ratio,
    then down so the shortest side is at most 768, count the 512-px tiles (each side
    rounded up) and charge 85 + 170 per tile.

    OpenAI's own examples, checked in tests/core/test_media.py:

    - 1024 × 1024, high: no fit needed; shortest side to 768 → 768 × 768 → 2 × 2 tiles →
      85 + 170·4 = 765.
    - 2048 × 4096, high: fit → 1024 × 2048; shortest side to 768 → 768 × 1536 → 2 × 3
      tiles → 85 + 170·6 = 1105.
    - 4096 × 8192, low: 85.

    The scaling is exact (rational, no rounding to whole pixels between the steps), so a
    side that lands a hair over a tile boundary pays for the tile: never an undercharge.
    Whatever the size, a high-detail image costs at most 85 + 170·8 = 1445. A width or
    height below 1 (which no readable image has) is taken as 1 rather than divided by.
    """
    if detail == "low":
        return LOW_DETAIL_TOKENS
    w, h = Fraction(max(width, 1)), Fraction(max(height, 1))
    fit = min(Fraction(1), FIT / max(w, h))
    w, h = w * fit, h * fit
    shrink = min(Fraction(1), SHORT_SIDE / min(w, h))
    w, h = w * shrink, h * shrink
    tiles = math.ceil(w / TILE) * math.ceil(h / TILE)
    return LOW_DETAIL_TOKENS + TILE_TOKENS * tiles


# -- reading an image's size ------------------------------------------------------------------

# The most decoded bytes read: a JPEG's SOF can follow EXIF data and thumbnails, which an
# APP1 segment holds up to 64 KiB of. A size not found by then is unknown.
MAX_DECODED_BYTES = 64 * 1024
# the base64 characters that decode to that many bytes
_B64_CHARS = 4 * -(-MAX_DECODED_BYTES // 3)
# the raw characters sliced off the URL: room for line breaks in the base64 (MIME wraps
# every 76 characters); the slice is all that is ever copied out of the URL
MAX_RAW_CHARS = 2 * _B64_CHARS
# "data:" up to the comma: a media type and a few parameters
_MAX_HEADER = 256
_NOT_BASE64 = re.compile(r"[^A-Za-z0-9+/]")
_URLSAFE = str.maketrans("-_", "+/")


def image_size(url: str) -> tuple[int, int] | None:
    """(width, height) of a `data:image/...;base64,` URL, read from the image header (PNG
    IHDR, GIF, JPEG SOFn markers, WebP VP8/VP8L/VP8X), decoding only a bounded prefix of the
    base64 (at most MAX_DECODED_BYTES: a JPEG's SOF can follow EXIF data); None for http(s)
    URLs, other data, or anything malformed — never raises on any input.

    The format is sniffed from the bytes, not taken from the declared media type: vLLM
    decodes whatever it is sent, so a PNG labelled ``application/octet-stream`` is still a
    PNG of that size. A zero width or height (a JPEG whose height comes later, in a DNL
    segment) is unknown, not free.
    """
    if not isinstance(url, str):
        return None
    head = _data_url_prefix(url)
    size = _sniff(head) if head is not None else None
    if size is None or size[0] <= 0 or size[1] <= 0:
        return None
    return size


def _data_url_prefix(url: str) -> bytes | None:
    """The first bytes of a base64 ``data:`` URL's payload; None for any other URL.

    Every operation here is on a bounded slice of ``url`` or a bounded ``find``: nothing
    copies, scans or decodes the whole of a huge URL.
    """
    if url[:5].lower() != "data:":
        return None
    comma = url.find(",", 5, _MAX_HEADER)
    if comma < 0:
        return None
    if url[5:comma].rsplit(";", 1)[-1].strip().lower() != "base64":
        return None
    return _decode_prefix(url[comma + 1 : comma + 1 + MAX_RAW_CHARS])


def _decode_prefix(chunk: str) -> bytes | None:
    """Up to MAX_DECODED_BYTES decoded from the start of a base64 string, forgiving what
    decoders forgive: whitespace and stray characters are dropped, the URL-safe alphabet is
    read as the standard one, and padding (which ends the data) is supplied if missing."""
    chunk = chunk.split("=", 1)[0]
    chunk = _NOT_BASE64.sub("", chunk.translate(_URLSAFE))[:_B64_CHARS]
    extra = len(chunk) % 4
    if extra == 1:  # a lone sextet decodes to nothing
        chunk = chunk[:-1]
    elif extra:
        chunk += "=" * (4 - extra)
    try:
        return binascii.a2b_base64(chunk)[:MAX_DECODED_BYTES]
    except binascii.Error:
        return None


def _sniff(head: bytes) -> tuple[int, int] | None:
    """(width, height) from whichever header ``head`` starts with, or None."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return _png(head)
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return _gif(head)
    if head[:2] == b"\xff\xd8":
        return _jpeg(head)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return _webp(head)
    return None


def _be(data: bytes, at: int, n: int) -> int:
    return int.from_bytes(data[at : at + n], "big")


def _le(data: bytes, at: int, n: int) -> int:
    return int.from_bytes(data[at : at + n], "little")


def _png(head: bytes) -> tuple[int, int] | None:
    """PNG: the IHDR chunk must come first; width and height are 4 bytes big-endian."""
    if len(head) < 24 or head[12:16] != b"IHDR":
        return None
    return _be(head, 16, 4), _be(head, 20, 4)


def _gif(head: bytes) -> tuple[int, int] | None:
    """GIF: the logical screen's width and height, 2 bytes little-endian, after the magic."""
    if len(head) < 10:
        return None
    return _le(head, 6, 2), _le(head, 8, 2)


# Start Of Frame markers, every coding (baseline, progressive, lossless, arithmetic): C0–CF
# except DHT (C4), JPG (C8) and DAC (CC), which are not frames
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# markers without a length: TEM, RST0–7, SOI
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD9)})


def _jpeg(head: bytes) -> tuple[int, int] | None:
    """JPEG: walk the marker segments to the first SOFn (precision, height, width).

    A scan (SOS) or the end (EOI) before any frame header, a segment that is not a marker,
    or a length shorter than itself means a corrupt file: None. Each step moves forward, so
    the walk ends within ``head``.
    """
    at = 2
    while at + 4 <= len(head):
        if head[at] != 0xFF:
            return None
        marker = head[at + 1]
        if marker == 0xFF:  # fill byte before a marker
            at += 1
            continue
        if marker in _STANDALONE:
            at += 2
            continue
        if marker in (0xD9, 0xDA):
            return None
        length = _be(head, at + 2, 2)
        if length < 2:
            return None
        if marker in _SOF:
            if at + 9 > len(head):
                return None
            return _be(head, at + 7, 2), _be(head, at + 5, 2)
        at += 2 + length
    return None


def _webp(head: bytes) -> tuple[int, int] | None:
    """WebP: the first chunk after ``RIFF....WEBP`` says how the size is stored.

    VP8 (lossy): a key frame's start code, then 14-bit width and height. VP8L (lossless):
    a 0x2F signature, then width−1 and height−1 in 14 bits each. VP8X (extended): the
    canvas's width−1 and height−1 in 24 bits each.
    """
    chunk = head[12:16]
    if chunk == b"VP8 " and len(head) >= 30 and head[23:26] == b"\x9d\x01\x2a":
        return _le(head, 26, 2) & 0x3FFF, _le(head, 28, 2) & 0x3FFF
    if chunk == b"VP8L" and len(head) >= 25 and head[20] == 0x2F:
        bits = _le(head, 21, 4)
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X" and len(head) >= 30:
        return _le(head, 24, 3) + 1, _le(head, 27, 3) + 1
    return None
