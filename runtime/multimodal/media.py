"""Media loading with limits: images from PIL objects, bytes, base64 data URLs, files under an allowed directory,
or http(s) when remote media is enabled; videos as lists of frames or as video files (animated GIF/WebP/PNG with
PIL, other formats when PyAV is installed).

Every way in is bounded: encoded bytes (`max_bytes`), decoded pixels (`max_pixels`, checked from the header before
decoding), frames per video, and the download's time. Remote fetches refuse hosts that resolve to loopback,
private, link-local or otherwise non-global addresses, at the first request and at every redirect. A user's
mistake raises `MediaError` (a ValueError naming the parameter), which the server answers with HTTP 400.
"""

from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import os
import socket
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Optional

from braid.runtime.core import RequestError

_MAX_REDIRECTS = 3


class MediaError(RequestError):
    pass


@dataclass(frozen=True)
class MediaLimits:
    max_bytes: int = 20 * 2**20  # one encoded image
    max_pixels: int = 4096 * 4096  # one decoded image or frame
    max_frames: int = 64  # one video
    max_items: int = 16  # images and videos in one request
    timeout_s: float = 10.0  # one remote download
    allowed_local_path: Optional[str] = None  # files readable from this directory (and below) only
    allow_remote: bool = False  # http(s) URLs

    @classmethod
    def from_server_args(cls, server_args) -> "MediaLimits":
        return cls(max_bytes=server_args.max_image_bytes, max_pixels=server_args.max_image_pixels,
                   max_frames=server_args.max_video_frames, max_items=server_args.max_media_items,
                   timeout_s=server_args.media_timeout_s, allowed_local_path=server_args.allowed_local_media_path,
                   allow_remote=server_args.allow_remote_media)


def load_image(source: Any, limits: MediaLimits, param: str = "image_data"):
    """A PIL image (RGB) from `source`; MediaError for anything not allowed or not an image."""
    from PIL import Image

    if isinstance(source, Image.Image):
        _check_pixels(source.size, limits, param)
        return source.convert("RGB")
    if isinstance(source, dict):  # OpenAI-style {"url": ...}
        source = source.get("url")
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, str):
        data = _read_source(source, limits, param)
    else:
        raise MediaError(f"an image must be a data URL, a file path, a URL or bytes, got {type(source).__name__}",
                         param)
    return decode_image(data, limits, param)


def load_video(source: Any, limits: MediaLimits, param: str = "video_data") -> list:
    """A video as its frames (PIL images), from a list of image sources (or {"frames": [...]}), or from a video
    file given like an image (data URL, allowed path, URL when enabled, bytes; or {"url": ..., "num_frames": n})
    and decoded with PIL (animated GIF, WebP, PNG) or, when it is installed, PyAV. `num_frames` evenly spaced
    frames are kept; without it every frame, which must be at most `max_frames`."""
    num_frames = None
    if isinstance(source, dict):
        if "frames" in source:
            source = source["frames"]
        else:
            num_frames, source = source.get("num_frames"), source.get("url")
    if isinstance(source, (list, tuple)):
        if not source:
            raise MediaError("a video needs at least one frame", param)
        if len(source) > limits.max_frames:
            raise MediaError(f"a video may have at most {limits.max_frames} frames, got {len(source)}", param)
        return [load_image(frame, limits, param) for frame in source]
    if isinstance(source, str):
        data = _read_source(source, limits, param)
    elif isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    else:
        raise MediaError("a video must be a list of frames or a video file (data URL, path, URL or bytes)", param)
    if len(data) > limits.max_bytes:
        raise MediaError(f"a video file may be at most {limits.max_bytes} bytes (--max-image-bytes)", param)
    if num_frames is not None and (not isinstance(num_frames, int) or isinstance(num_frames, bool)
                                   or not 1 <= num_frames <= limits.max_frames):
        raise MediaError(f"num_frames must be an integer in [1, {limits.max_frames}]", param)
    return _decode_video(data, num_frames, limits, param)


def _evenly_spaced(total: int, count: int) -> list[int]:
    if count >= total:
        return list(range(total))
    return [round(i * (total - 1) / max(count - 1, 1)) for i in range(count)]


def _decode_video(data: bytes, num_frames: Optional[int], limits: MediaLimits, param: str) -> list:
    from PIL import Image, UnidentifiedImageError

    def pick(total: int) -> list[int]:
        if num_frames is None and total > limits.max_frames:
            raise MediaError(f"the video has {total} frames, at most {limits.max_frames} are allowed; pass "
                             "num_frames to sample fewer", param)
        return _evenly_spaced(total, num_frames or total)

    try:
        img = Image.open(io.BytesIO(data))
        total = getattr(img, "n_frames", 1)
        if total > 1:
            _check_pixels(img.size, limits, param)
            frames = []
            for index in pick(total):
                img.seek(index)
                frames.append(img.convert("RGB"))
            return frames
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        pass
    try:
        import av
    except ImportError:
        raise MediaError("the video is not an animated GIF/WebP/PNG; other video formats need PyAV installed on the "
                         "server (or send frames)", param) from None
    try:
        with av.open(io.BytesIO(data)) as container:
            frames = []
            for frame in container.decode(video=0):
                frames.append(frame)
                if num_frames is None and len(frames) > limits.max_frames:
                    pick(len(frames))  # raises: too many frames
            images = [frames[i].to_image() for i in pick(len(frames))]
    except MediaError:
        raise
    except Exception as e:  # noqa: BLE001 - PyAV raises its own error classes for undecodable input
        raise MediaError(f"the {param} payload is not a decodable video ({type(e).__name__})", param) from None
    if not images:
        raise MediaError("the video has no frames", param)
    for im in images:
        _check_pixels(im.size, limits, param)
    return [im.convert("RGB") for im in images]


def decode_image(data: bytes, limits: MediaLimits, param: str):
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise MediaError(f"an image may be at most {limits.max_bytes} bytes, got {len(data)}", param)
    try:
        img = Image.open(io.BytesIO(data))
        _check_pixels(img.size, limits, param)
        img.load()
        return img.convert("RGB")
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise MediaError(f"the {param} payload is not a readable image ({type(e).__name__})", param) from None


def _check_pixels(size: tuple[int, int], limits: MediaLimits, param: str) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise MediaError("an image must have at least one pixel", param)
    if width * height > limits.max_pixels:
        raise MediaError(f"an image may have at most {limits.max_pixels} pixels, got {width}x{height}", param)


def _read_source(source: str, limits: MediaLimits, param: str) -> bytes:
    if source.startswith("data:"):
        return _decode_data_url(source, limits, param)
    scheme = urllib.parse.urlsplit(source).scheme.lower()
    if scheme in ("http", "https"):
        if not limits.allow_remote:
            raise MediaError("remote media URLs are disabled on this server (--allow-remote-media)", param)
        return _download(source, limits, param)
    if scheme == "file":
        return _read_file(urllib.parse.unquote(urllib.parse.urlsplit(source).path), limits, param)
    if scheme and len(scheme) > 1:  # "c:" would be a Windows drive, not a scheme
        raise MediaError(f"media URL scheme {scheme!r} is not supported (data:, file:, http(s):)", param)
    if not _may_be_path(source, limits):
        raise MediaError("media must be a data URL (data:image/png;base64,<base64 bytes>), an http(s) URL or a file "
                         f"path; got {_describe(source)}", param)
    return _read_file(source, limits, param)


_BASE64_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=\n\r")


def _is_raw_base64(source: str) -> bool:
    """Long and only base64's characters: no file name (which may start with "/": a JPEG's base64 starts "/9j/")."""
    return len(source) >= 64 and set(source) <= _BASE64_CHARS


def _may_be_path(source: str, limits: MediaLimits) -> bool:
    """Whether `source` can be meant as a file path, so that the answer may be about local files. With local files
    disabled, only what looks like one counts: a directory or a file extension (absolute, ./, ../ included)."""
    if not source.strip() or _is_raw_base64(source):
        return False
    return limits.allowed_local_path is not None or any(c in source for c in "/\\.") or source.startswith("~")


def _describe(source: str) -> str:
    if not source.strip():
        return "an empty string"
    if _is_raw_base64(source):
        return "raw base64; prefix it with data:image/<format>;base64,"
    return "a string that is none of these"


def _decode_data_url(url: str, limits: MediaLimits, param: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise MediaError("a data URL must be base64: data:<mime>;base64,<payload>", param)
    if len(payload) > limits.max_bytes * 4 // 3 + 4:
        raise MediaError(f"an image may be at most {limits.max_bytes} bytes", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data URL's base64 payload is malformed", param) from None


def _read_file(path: str, limits: MediaLimits, param: str) -> bytes:
    if limits.allowed_local_path is None:
        raise MediaError("local media files are disabled on this server (--allowed-local-media-path)", param)
    root = os.path.realpath(limits.allowed_local_path)
    real = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, real]) != root:
        raise MediaError("the media file is outside the allowed directory", param)
    if not os.path.isfile(real):
        raise MediaError("the media file does not exist", param)
    if os.path.getsize(real) > limits.max_bytes:
        raise MediaError(f"an image may be at most {limits.max_bytes} bytes", param)
    with open(real, "rb") as f:
        return f.read()


def _check_host(url: str, param: str) -> None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise MediaError("remote media must be an http(s) URL with a host", param)
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80),
                                   proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        raise MediaError("the media URL's host does not resolve", param) from None
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%")[0])
        if not address.is_global:
            raise MediaError("the media URL resolves to a loopback, private or reserved address", param)


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    def __init__(self, param: str):
        self.param = param
        self.count = 0

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self.count += 1
        if self.count > _MAX_REDIRECTS:
            raise MediaError("the media URL redirects too often", self.param)
        _check_host(newurl, self.param)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _download(url: str, limits: MediaLimits, param: str) -> bytes:
    _check_host(url, param)
    opener = urllib.request.build_opener(_CheckedRedirects(param))
    deadline = time.monotonic() + limits.timeout_s
    try:
        with opener.open(url, timeout=limits.timeout_s) as resp:
            chunks, total = [], 0
            while True:
                if time.monotonic() > deadline:
                    raise MediaError(f"the media download took longer than {limits.timeout_s} s", param)
                chunk = resp.read(65536)
                if not chunk:
                    break
                total += len(chunk)
                if total > limits.max_bytes:
                    raise MediaError(f"an image may be at most {limits.max_bytes} bytes", param)
                chunks.append(chunk)
            return b"".join(chunks)
    except MediaError:
        raise
    except (OSError, ValueError) as e:
        raise MediaError(f"the media URL could not be fetched ({type(e).__name__})", param) from None
