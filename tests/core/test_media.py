"""Pricing of image, audio, file and video content parts (core/media.py, issue 16).

Adversarial first: a part is whatever JSON a tenant sends, and an image is whatever bytes
they claim, so nothing here may raise, hang, or price a media part at zero. Then the real
headers (built by hand per the format specs, and by Pillow where it is installed) and
OpenAI's published examples of the image price.
"""

from __future__ import annotations

import base64
import io
import struct
import zlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sfq_proxy.core import media
from sfq_proxy.core.media import (
    LOW_DETAIL_TOKENS,
    MAX_DECODED_BYTES,
    MAX_IMAGE_TOKENS,
    MAX_RAW_CHARS,
    TEXT_TYPES,
    Media,
    image_size,
    image_tokens,
    media_part,
)

KINDS = {"image", "audio", "file", "video"}

# -- image headers, by hand (PNG: RFC 2083; GIF89a; JPEG: ITU T.81; WebP: RFC 9649) ---------


def png(width: int, height: int) -> bytes:
    """A PNG's signature and IHDR chunk (8-bit RGB), CRC included."""
    ihdr = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", 13) + ihdr + struct.pack(">I", zlib.crc32(ihdr))
    return b"\x89PNG\r\n\x1a\n" + chunk


def gif(width: int, height: int) -> bytes:
    """A GIF's magic and logical screen descriptor."""
    return b"GIF89a" + struct.pack("<HHBBB", width, height, 0, 0, 0)


def segment(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload


def jpeg(width: int, height: int, *, sof: int = 0xC0, app1: int = 16) -> bytes:
    """SOI, an APP0 (JFIF), an APP1 of ``app1`` bytes (EXIF's place), a DQT, then the frame
    header: what a camera's JPEG looks like up to its size."""
    return (
        b"\xff\xd8"
        + segment(0xE0, b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00")
        + segment(0xE1, b"Exif\x00\x00" + bytes(max(app1 - 6, 0)))
        + segment(0xDB, bytes(65))
        + b"\xff\xff"  # fill bytes may precede a marker
        + segment(sof, struct.pack(">BHHB", 8, height, width, 3) + bytes(9))
        + segment(0xDA, bytes(10))
    )


def riff(chunk: bytes, payload: bytes) -> bytes:
    body = b"WEBP" + chunk + struct.pack("<I", len(payload)) + payload
    return b"RIFF" + struct.pack("<I", len(body)) + body


def webp_vp8(width: int, height: int) -> bytes:
    """Lossy: a key frame's 3-byte tag, the start code, 14-bit width and height."""
    return riff(b"VP8 ", b"\x9d\x01\x00" + b"\x9d\x01\x2a" + struct.pack("<HH", width, height))


def webp_vp8l(width: int, height: int) -> bytes:
    """Lossless: the 0x2F signature, then width−1 and height−1 in 14 bits each."""
    bits = (width - 1) | (height - 1) << 14
    return riff(b"VP8L", b"\x2f" + struct.pack("<I", bits))


def webp_vp8x(width: int, height: int) -> bytes:
    """Extended: flags, 3 reserved bytes, canvas width−1 and height−1 in 24 bits each."""
    sizes = (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    return riff(b"VP8X", bytes(4) + sizes)


HEADERS = {
    "png": png,
    "gif": gif,
    "jpeg": jpeg,
    "jpeg-progressive": lambda w, h: jpeg(w, h, sof=0xC2),
    "webp-vp8": webp_vp8,
    "webp-vp8l": webp_vp8l,
    "webp-vp8x": webp_vp8x,
}


def data_url(raw: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(raw).decode()}"


def image_part(url: Any, detail: Any = None) -> dict[str, Any]:
    image_url: dict[str, Any] = {"url": url}
    if detail is not None:
        image_url["detail"] = detail
    return {"type": "image_url", "image_url": image_url}


# -- adversarial: any JSON part ----------------------------------------------------------------

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
keys = st.sampled_from(
    ["type", "text", "image_url", "url", "detail", "input_audio", "audio_url", "video_url",
     "file", "uuid", "data", "format", "image_pil", "image_embeds"]
) | st.text(max_size=8)  # fmt: skip
types = st.sampled_from(sorted(TEXT_TYPES | set(media._TYPE_KINDS))) | scalars
urls = st.one_of(
    scalars,
    st.builds(lambda s: "data:image/png;base64," + s, st.text(max_size=200)),
    st.builds(data_url, st.binary(max_size=64)),
    st.builds(lambda f, w, h: data_url(f(w, h)), st.sampled_from(list(HEADERS.values())),
              st.integers(1, 16383), st.integers(1, 16383)),
    st.just("https://example.com/cat.png"),
)  # fmt: skip
json_values = st.recursive(
    scalars | urls,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=5),
    max_leaves=20,
)
parts = st.one_of(
    json_values,
    st.dictionaries(keys, json_values, max_size=6),
    st.builds(lambda t, rest: {**rest, "type": t}, types, st.dictionaries(keys, json_values)),
    st.builds(lambda t, u, d: {"type": t, "image_url": {"url": u, "detail": d}},
              types, urls, json_values),
    st.builds(lambda t, u, d: {"type": t, "image_url": u, "detail": d}, types, urls, json_values),
)  # fmt: skip


def is_priced(result: Media | None) -> bool:
    """A Media of a known kind whose tokens, if known, are a real image price."""
    return (
        isinstance(result, Media)
        and result.kind in KINDS
        and (result.tokens is None or LOW_DETAIL_TOKENS <= result.tokens <= MAX_IMAGE_TOKENS)
    )


def str_in(value: Any, names: frozenset[str]) -> bool:
    return isinstance(value, str) and value in names


@given(parts)
def test_any_json_part_is_text_or_priced_media_and_never_raises(part: Any) -> None:
    result = media_part(part)
    assert result is None or is_priced(result)
    if result is None:  # only text is free
        assert isinstance(part, str) or (
            isinstance(part, dict)
            and (part.get("type") is None or str_in(part.get("type"), TEXT_TYPES))
            and not set(part) & {field for field, _ in media._FIELD_KINDS}
        )


@given(st.text().filter(lambda t: t not in TEXT_TYPES and t not in media._TYPE_KINDS))
def test_a_part_of_an_unknown_type_is_a_file(kind: str) -> None:
    assert media_part({"type": kind, "image_url": {"url": "x"}}) == Media("file", None)


not_strings = st.booleans() | st.integers() | st.floats()


@given(not_strings | st.lists(scalars) | st.dictionaries(keys, scalars))
def test_a_type_that_is_not_a_string_is_a_file(kind: Any) -> None:
    assert media_part({"type": kind}) == Media("file", None)


@given(json_values)
def test_an_image_url_part_with_garbage_is_an_image_of_unknown_size(garbage: Any) -> None:
    for part in ({"type": "image_url", "image_url": garbage}, image_part(garbage)):
        result = media_part(part)
        assert result is not None
        assert result.kind == "image"
        assert is_priced(result)


@given(json_values)
def test_a_non_object_part_is_text_if_a_string_else_a_file(value: Any) -> None:
    if isinstance(value, dict):
        return
    expected = None if isinstance(value, str) else Media("file", None)
    assert media_part(value) == expected


# -- adversarial: any URL, any bytes ---------------------------------------------------------


def is_size(size: tuple[int, int] | None) -> bool:
    return size is None or (
        isinstance(size, tuple) and len(size) == 2 and size[0] > 0 and size[1] > 0
    )


@given(st.text())
def test_image_size_of_any_string_never_raises(url: str) -> None:
    assert is_size(image_size(url))


@given(st.sampled_from(["data:image/png;base64,", "data:;base64,", "DATA:image/jpeg;BASE64,"]),
       st.text())  # fmt: skip
def test_image_size_of_any_base64_payload_never_raises(prefix: str, payload: str) -> None:
    assert is_size(image_size(prefix + payload))


@given(st.binary(max_size=300))
def test_image_size_of_any_bytes_never_raises(raw: bytes) -> None:
    assert is_size(image_size(data_url(raw)))


@given(st.sampled_from(list(HEADERS)), st.binary(max_size=200))
def test_a_real_magic_followed_by_garbage_never_raises(name: str, garbage: bytes) -> None:
    header = HEADERS[name](100, 50)
    for magic_length in (2, 4, 8, 12, 16):
        assert is_size(image_size(data_url(header[:magic_length] + garbage)))


@given(st.sampled_from(list(HEADERS)), st.integers(1, 16383), st.integers(1, 16383), st.data())
def test_a_truncated_header_gives_none_or_the_true_size(
    name: str, width: int, height: int, data: st.DataObject
) -> None:
    """Cut anywhere, in the bytes or in the base64: never a wrong size, never an error."""
    raw = HEADERS[name](width, height)
    encoded = base64.b64encode(raw).decode()
    cut = data.draw(st.integers(0, len(encoded)))
    assert image_size("data:image/png;base64," + encoded[:cut]) in (None, (width, height))
    cut = data.draw(st.integers(0, len(raw)))
    assert image_size(data_url(raw[:cut])) in (None, (width, height))


@given(st.sampled_from(list(HEADERS)), st.data())
def test_a_corrupted_header_never_raises(name: str, data: st.DataObject) -> None:
    raw = bytearray(HEADERS[name](640, 480))
    for _ in range(data.draw(st.integers(1, 8))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    size = image_size(data_url(bytes(raw)))
    assert is_size(size)
    result = media_part(image_part(data_url(bytes(raw))))
    assert is_priced(result)


@pytest.mark.parametrize(
    ("raw", "size"),
    [
        (png(65535, 65535), (65535, 65535)),
        (png(2**32 - 1, 2**32 - 1), (2**32 - 1, 2**32 - 1)),
        (png(2**32 - 1, 1), (2**32 - 1, 1)),
        (gif(65535, 65535), (65535, 65535)),
        (jpeg(65535, 65535), (65535, 65535)),
        (webp_vp8(16383, 16383), (16383, 16383)),
        (webp_vp8l(16384, 16384), (16384, 16384)),
        (webp_vp8x(2**24, 2**24), (2**24, 2**24)),
    ],
    ids=["png-65535", "png-2^32-1", "png-sliver", "gif", "jpeg", "vp8", "vp8l", "vp8x"],
)
def test_a_huge_declared_size_is_read_and_its_price_is_finite(
    raw: bytes, size: tuple[int, int]
) -> None:
    """The 2048 fit bounds the price: a 65535 × 65535 image costs what a 768 × 768 one does."""
    assert image_size(data_url(raw)) == size
    tokens = media_part(image_part(data_url(raw), "high"))
    assert tokens is not None
    assert tokens.tokens is not None
    assert LOW_DETAIL_TOKENS < tokens.tokens <= MAX_IMAGE_TOKENS
    if size[0] == size[1]:
        assert tokens.tokens == 765


@pytest.mark.parametrize(
    "raw",
    [png(0, 100), png(100, 0), gif(0, 0), jpeg(100, 0), jpeg(0, 100), webp_vp8(0, 10)],
    ids=["png-w0", "png-h0", "gif-0x0", "jpeg-h0-dnl", "jpeg-w0", "vp8-w0"],
)
def test_a_zero_width_or_height_is_an_unknown_size_not_a_division_by_zero(raw: bytes) -> None:
    assert image_size(data_url(raw)) is None
    assert media_part(image_part(data_url(raw))) == Media("image", None)


@given(st.integers(-(2**40), 0), st.integers(-(2**40), 2**40), st.text(max_size=6))
def test_image_tokens_never_divides_by_zero(width: int, height: int, detail: str) -> None:
    for w, h in ((width, height), (height, width)):
        assert LOW_DETAIL_TOKENS <= image_tokens(w, h, detail) <= MAX_IMAGE_TOKENS


def test_base64_with_line_breaks_spaces_and_bad_padding_is_still_read() -> None:
    raw = png(1920, 1080) + bytes(200)
    standard = base64.b64encode(raw).decode()
    variants = {
        "mime line breaks": base64.encodebytes(raw).decode(),
        "crlf": base64.encodebytes(raw).decode().replace("\n", "\r\n"),
        "spaces": " ".join(standard[i : i + 10] for i in range(0, len(standard), 10)),
        "no padding": standard.rstrip("="),
        "too much padding": standard.rstrip("=") + "=====",
        "urlsafe": base64.urlsafe_b64encode(raw).decode(),
        "stray characters": standard[:8] + "!*" + standard[8:],
        "percent-less garbage after": standard + "%%%",
    }
    for name, encoded in variants.items():
        assert image_size("data:image/png;base64," + encoded) == (1920, 1080), name


def test_a_padding_character_ends_the_data_and_nothing_raises() -> None:
    raw = png(300, 200)
    encoded = base64.b64encode(raw[:10]).decode() + base64.b64encode(raw[10:]).decode()
    assert "=" in encoded[:-4]  # padding in the middle
    assert image_size("data:image/png;base64," + encoded) is None  # read as a 10-byte PNG
    assert image_size("data:image/png;base64,====" + encoded) is None


# -- the bound: a 50 MB URL is never decoded, copied or scanned whole -------------------------


class WholeStringTouched(AssertionError):
    pass


class HugeUrl(str):
    """A str that records the slices taken of it and fails any method that would copy or
    scan it whole (the C-level ones that never go through ``__getitem__``)."""

    slices: list[int]

    def __getitem__(self, key: Any) -> str:
        piece = str.__getitem__(self, key)
        self.slices.append(len(piece))
        return piece

    def _whole(self, *args: Any, **kwargs: Any) -> Any:
        raise WholeStringTouched

    __iter__ = __contains__ = _whole
    lower = upper = casefold = strip = lstrip = rstrip = _whole
    split = rsplit = partition = rpartition = splitlines = _whole
    replace = translate = encode = count = index = rindex = rfind = _whole


def huge(prefix: str, total: int) -> HugeUrl:
    url = HugeUrl(prefix + "A" * (total - len(prefix)))
    url.slices = []
    return url


def test_a_50_mb_data_url_is_read_from_a_bounded_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list[tuple[int, int]] = []
    decode = media._decode_prefix

    def spy(chunk: str) -> bytes | None:
        out = decode(chunk)
        decoded.append((len(chunk), len(out or b"")))
        return out

    monkeypatch.setattr(media, "_decode_prefix", spy)
    header = base64.b64encode(png(4000, 3000)).decode()  # 33 bytes: no padding
    url = huge("data:image/png;base64," + header, 50_000_000)

    assert image_size(url) == (4000, 3000)
    assert url.slices
    assert max(url.slices) <= MAX_RAW_CHARS
    assert sum(url.slices) <= MAX_RAW_CHARS + 1024
    assert decoded == [(MAX_RAW_CHARS, MAX_DECODED_BYTES)]

    unreadable = huge("data:image/jpeg;base64,/9j/", 50_000_000)  # a JPEG that never ends
    assert image_size(unreadable) is None
    assert max(unreadable.slices) <= MAX_RAW_CHARS


def test_a_50_mb_non_data_url_is_not_scanned() -> None:
    for prefix in ("https://example.com/", "data:image/png", "data:" + "x" * 300 + ","):
        url = huge(prefix, 50_000_000)
        assert image_size(url) is None
        assert max(url.slices, default=0) <= 256


def test_a_size_past_the_bound_is_unknown_and_one_before_it_is_read() -> None:
    """A JPEG's EXIF can push its SOF far in: read within MAX_DECODED_BYTES, unknown after."""
    assert image_size(data_url(jpeg(4032, 3024, app1=60_000))) == (4032, 3024)
    past = jpeg(4032, 3024, app1=65_530) + bytes(20_000)
    assert len(past) > MAX_DECODED_BYTES
    assert image_size(data_url(past)) is None
    assert media_part(image_part(data_url(past))) == Media("image", None)


# -- real headers ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(HEADERS))
@pytest.mark.parametrize("size", [(1, 1), (640, 480), (480, 640), (1024, 1024), (4000, 3000)])
def test_a_hand_built_header_gives_its_size(name: str, size: tuple[int, int]) -> None:
    assert image_size(data_url(HEADERS[name](*size))) == size


def test_the_format_is_sniffed_not_taken_from_the_declared_type() -> None:
    """vLLM decodes whatever it is sent: a mislabelled image is priced by its real size."""
    assert image_size(data_url(png(800, 600), "image/jpeg")) == (800, 600)
    assert image_size(data_url(gif(800, 600), "application/octet-stream")) == (800, 600)
    assert image_size(data_url(jpeg(800, 600), "")) == (800, 600)
    assert image_size("DATA:IMAGE/PNG;BASE64," + data_url(png(8, 6)).split(",")[1]) == (8, 6)
    charset = "data:image/png;charset=utf-8;base64," + data_url(png(8, 6)).split(",")[1]
    assert image_size(charset) == (8, 6)


@pytest.mark.parametrize(
    "url",
    [
        "https://example.com/cat.png",
        "http://example.com/cat.png",
        "file:///etc/passwd",
        "data:image/png," + "%89PNG",  # not base64
        "data:image/png;base64",  # no comma
        "data:image/png;base64,",
        "data:image/svg+xml;base64," + base64.b64encode(b"<svg width='9' height='9'/>").decode(),
        "data:image/bmp;base64," + base64.b64encode(b"BM" + bytes(60)).decode(),
        "",
        "data:",
    ],
)
def test_what_is_not_a_readable_inline_image_has_no_size(url: str) -> None:
    assert image_size(url) is None


def test_a_jpeg_scan_before_any_frame_header_has_no_size() -> None:
    assert image_size(data_url(b"\xff\xd8" + segment(0xDA, bytes(10)))) is None
    assert image_size(data_url(b"\xff\xd8\xff\xd9")) is None
    assert image_size(data_url(b"\xff\xd8\x00\x00\x00\x00")) is None  # not a marker
    assert image_size(data_url(b"\xff\xd8\xff\xe0\x00\x01" + bytes(20))) is None  # length 1


PILLOW_FORMATS = [("PNG", {}), ("GIF", {}), ("JPEG", {}), ("JPEG", {"progressive": True}),
                  ("WEBP", {}), ("WEBP", {"lossless": True})]  # fmt: skip


@pytest.mark.parametrize(("fmt", "options"), PILLOW_FORMATS, ids=lambda v: str(v))
@pytest.mark.parametrize("size", [(1, 1), (37, 1000), (1000, 37), (1920, 1080)])
def test_a_real_image_made_by_pillow_gives_its_size(
    fmt: str, options: dict[str, Any], size: tuple[int, int]
) -> None:
    image_module = pytest.importorskip("PIL.Image")
    buffer = io.BytesIO()
    image_module.new("RGB", size, (200, 30, 30)).save(buffer, fmt, **options)
    assert image_size(data_url(buffer.getvalue(), f"image/{fmt.lower()}")) == size


def test_a_real_jpeg_with_exif_gives_its_size() -> None:
    image_module = pytest.importorskip("PIL.Image")
    image = image_module.new("RGB", (300, 200))
    exif = image.getexif()
    exif[0x010E] = "x" * 30_000  # ImageDescription: a big APP1 before the frame header
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", exif=exif)
    assert len(buffer.getvalue()) > 30_000
    assert image_size(data_url(buffer.getvalue(), "image/jpeg")) == (300, 200)


def test_a_real_webp_with_alpha_is_extended_and_gives_its_canvas_size() -> None:
    image_module = pytest.importorskip("PIL.Image")
    buffer = io.BytesIO()
    image_module.new("RGBA", (123, 45), (0, 0, 0, 128)).save(buffer, "WEBP")
    assert buffer.getvalue()[12:16] in (b"VP8X", b"VP8L")
    assert image_size(data_url(buffer.getvalue(), "image/webp")) == (123, 45)


# -- the image price: OpenAI's examples and the rule ------------------------------------------


@pytest.mark.parametrize(
    ("width", "height", "detail", "tokens"),
    [
        (1024, 1024, "high", 765),  # → 768 × 768: 4 tiles
        (2048, 4096, "high", 1105),  # → 1024 × 2048 → 768 × 1536: 6 tiles
        (4096, 8192, "low", 85),  # low is flat, whatever the size
    ],
)
def test_openai_s_published_examples(width: int, height: int, detail: str, tokens: int) -> None:
    assert image_tokens(width, height, detail) == tokens


@pytest.mark.parametrize(
    ("width", "height", "tokens"),
    [
        (1, 1, 255),  # never scaled up: one tile
        (512, 512, 255),
        (513, 512, 425),  # a pixel over a tile pays for the next
        (768, 768, 765),
        (1000, 3000, 1445),  # → 682.7 × 2048: 2 × 4 tiles, the most an image can cost
        (65535, 1, 765),  # → 2048 × 0.03: 4 × 1 tiles
        (4000, 3000, 765),  # → 2048 × 1536 → 1024 × 768: 2 × 2 tiles
    ],
)
def test_the_rule_at_its_edges(width: int, height: int, tokens: int) -> None:
    assert image_tokens(width, height, "high") == tokens
    assert image_tokens(height, width, "high") == tokens


@given(st.integers(1, 2**40), st.integers(1, 2**40), st.text(max_size=8))
def test_any_size_and_detail_costs_between_85_and_1445(
    width: int, height: int, detail: str
) -> None:
    tokens = image_tokens(width, height, detail)
    assert LOW_DETAIL_TOKENS <= tokens <= MAX_IMAGE_TOKENS
    assert (tokens - LOW_DETAIL_TOKENS) % 170 == 0
    assert tokens == image_tokens(height, width, detail)
    if detail == "low":
        assert tokens == LOW_DETAIL_TOKENS
    else:  # auto, high and anything unknown: priced as high
        assert tokens == image_tokens(width, height, "high") >= image_tokens(1, 1, "high")


def test_auto_and_unknown_details_are_priced_as_high() -> None:
    for detail in ("auto", "HIGH", "Low", "", "ultra"):
        assert image_tokens(1024, 1024, detail) == 765


# -- media_part: what each part is priced as ---------------------------------------------------


@pytest.mark.parametrize(
    "part",
    [
        {"type": "text", "text": "hello"},
        {"text": "no type"},
        {},
        "a bare string part",
        {"type": "refusal", "refusal": "no"},
        {"type": "input_text", "text": "responses api"},
        {"type": None, "text": "null type"},
    ],
)
def test_text_is_free_here(part: Any) -> None:
    assert media_part(part) is None


@pytest.mark.parametrize(
    ("part", "expected"),
    [
        ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}, "audio"),
        ({"type": "audio_url", "audio_url": {"url": "https://x/a.mp3"}}, "audio"),
        ({"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBER"}}, "file"),
        ({"type": "file", "file": {"file_id": "file-abc"}}, "file"),
        ({"type": "input_file", "file_id": "file-abc"}, "file"),
        ({"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}, "video"),
        ({"type": "image_embeds", "image_embeds": "..."}, "image"),
        ({"type": "prompt_embeds", "data": "..."}, "file"),
        ({"type": "hologram", "hologram": {}}, "file"),
        ({"type": ["image_url"]}, "file"),
        (42, "file"),
        (None, "file"),
        ([{"type": "image_url"}], "file"),
    ],
)
def test_each_media_type_is_priced_as_its_kind(part: Any, expected: media.Kind) -> None:
    assert media_part(part) == Media(expected, None)


def test_an_inline_image_is_priced_by_its_size() -> None:
    url = data_url(png(2048, 4096))
    assert media_part(image_part(url, "high")) == Media("image", 1105)
    assert media_part(image_part(url, "auto")) == Media("image", 1105)
    assert media_part(image_part(url)) == Media("image", 1105)
    assert media_part(image_part(url, "low")) == Media("image", 85)
    assert media_part(image_part(url, 7)) == Media("image", 1105)  # a garbage detail: high


def test_an_image_of_unknown_size_is_left_to_the_pool_unless_low_detail() -> None:
    for url in ("https://example.com/cat.png", "data:image/png;base64,bm9wZQ==", None, 3):
        assert media_part(image_part(url)) == Media("image", None)
        assert media_part(image_part(url, "high")) == Media("image", None)
        assert media_part(image_part(url, "low")) == Media("image", 85)


def test_a_bare_string_image_url_is_an_image() -> None:
    url = data_url(png(1024, 1024))
    assert media_part({"type": "image_url", "image_url": url}) == Media("image", 765)
    assert media_part({"type": "image_url", "image_url": "https://x/c.png"}) == Media("image", None)


def test_the_responses_api_input_image_takes_its_detail_from_the_part() -> None:
    url = data_url(png(1024, 1024))
    assert media_part({"type": "input_image", "image_url": url}) == Media("image", 765)
    low = {"type": "input_image", "image_url": "https://x/c.png", "detail": "low"}
    assert media_part(low) == Media("image", 85)
    assert media_part({"type": "input_image", "file_id": "file-1"}) == Media("image", None)


def test_the_detail_inside_an_image_url_object_wins_over_one_beside_it() -> None:
    """Only a bare-string image_url takes the part's own detail: a stray top-level "low" does
    not make an image_url object cheap."""
    part = {**image_part(data_url(png(1024, 1024)), "high"), "detail": "low"}
    assert media_part(part) == Media("image", 765)
    part = {**image_part("https://x/c.png"), "detail": "low"}
    assert media_part(part) == Media("image", None)


@pytest.mark.parametrize(
    ("part", "expected"),
    [
        ({"image_url": {"url": data_url(png(1024, 1024))}}, Media("image", 765)),
        ({"image_url": "https://x/c.png"}, Media("image", None)),
        ({"image_url": None, "uuid": "cached"}, Media("image", None)),
        ({"video_url": "https://x/v.mp4"}, Media("video", None)),
        ({"audio_url": "https://x/a.mp3"}, Media("audio", None)),
        ({"input_audio": {"data": "", "format": "wav"}}, Media("audio", None)),
        ({"image_embeds": "..."}, Media("image", None)),
        ({"type": "text", "text": "hi", "uuid": "u", "video_url": "x"}, Media("video", None)),
    ],
)
def test_a_typeless_or_text_part_carrying_media_is_that_media(
    part: dict[str, Any], expected: Media
) -> None:
    """vLLM reads a part with no type, or with a uuid whatever its type, by its media field:
    such a part must not pass for free text."""
    assert media_part(part) == expected


def test_media_is_a_frozen_slotted_value() -> None:
    item = Media("image", 85)
    with pytest.raises(AttributeError):
        item.tokens = 0  # type: ignore[misc]
    assert not hasattr(item, "__dict__")
    assert item == Media("image", 85)
    assert hash(item) == hash(Media("image", 85))
