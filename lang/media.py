"""Images and videos -> data URLs (what backends send as image_data / image_url parts)."""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path
from typing import Any

from braid.errors import ProgramError

_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
)
_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp"}


def _mime_of(data: bytes) -> str:
    for magic, mime in _MAGIC:
        if data.startswith(magic):
            return mime
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    raise ProgramError("image bytes are not PNG, JPEG, GIF, BMP or WebP")


def bytes_to_data_url(data: bytes) -> str:
    return f"data:{_mime_of(data)};base64,{base64.b64encode(data).decode('ascii')}"


def _pil_to_png_bytes(img: Any) -> bytes:
    buf = io.BytesIO()
    if img.mode not in ("RGB", "RGBA", "L"):
        img = img.convert("RGB")
    img.save(buf, format="PNG")
    return buf.getvalue()


def _is_pil_image(obj: Any) -> bool:
    try:
        from PIL import Image as PILImage
    except ImportError:  # pillow is a dependency, but an image can only be a PIL one if it is installed
        return False
    return isinstance(obj, PILImage.Image)


def image_to_data_url(source: Any) -> str:
    """A path, http(s) URL, data URL, raw bytes or PIL.Image -> a data URL."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes_to_data_url(bytes(source))
    if _is_pil_image(source):
        return bytes_to_data_url(_pil_to_png_bytes(source))
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str):
        raise ProgramError(f"image() takes a path, URL, bytes or PIL.Image, got {type(source).__name__}")
    if source.startswith("data:"):
        return source
    if source.startswith(("http://", "https://")):
        import requests

        try:
            resp = requests.get(source, timeout=30)
            resp.raise_for_status()
        except requests.RequestException as e:
            raise ProgramError(f"could not download image {source}: {e}") from None
        return bytes_to_data_url(resp.content)
    path = Path(source).expanduser()
    if not path.is_file():
        raise ProgramError(f"image file not found: {source}")
    return bytes_to_data_url(path.read_bytes())


def _evenly_spaced(total: int, k: int) -> list[int]:
    if total <= 0:
        return []
    k = min(k, total)
    return [int(i * total / k) for i in range(k)]


def video_to_frame_data_urls(source: Any, num_frames: int) -> list[str]:
    """`num_frames` evenly spaced frames of a video as data URLs. Accepts a list of images, a folder
    of image files, an animated image (GIF/WebP/APNG, via Pillow), or a video file when OpenCV or
    PyAV is installed."""
    if not isinstance(num_frames, int) or num_frames < 1:
        raise ProgramError(f"num_frames must be a positive integer, got {num_frames!r}")
    if isinstance(source, (list, tuple)):
        return [image_to_data_url(source[i]) for i in _evenly_spaced(len(source), num_frames)]
    path = Path(os.fspath(source)).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES)
        if not files:
            raise ProgramError(f"video folder {path} has no image files")
        return [image_to_data_url(files[i]) for i in _evenly_spaced(len(files), num_frames)]
    if not path.is_file():
        raise ProgramError(f"video file not found: {source}")
    for reader in (_frames_with_pillow, _frames_with_opencv, _frames_with_pyav):
        frames = reader(path, num_frames)
        if frames:
            return frames
    raise ProgramError(f"cannot decode video {path}: install opencv-python or av, or pass a folder of frames")


def _frames_with_pillow(path: Path, num_frames: int) -> list[str]:
    from PIL import Image as PILImage, UnidentifiedImageError

    try:
        img = PILImage.open(path)
    except (UnidentifiedImageError, OSError):
        return []
    total = getattr(img, "n_frames", 1)
    out = []
    for i in _evenly_spaced(total, num_frames):
        img.seek(i)
        out.append(bytes_to_data_url(_pil_to_png_bytes(img.convert("RGB"))))
    return out


def _frames_with_opencv(path: Path, num_frames: int) -> list[str]:
    try:
        import cv2
    except ImportError:
        return []
    cap = cv2.VideoCapture(str(path))
    total = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
    out = []
    for i in _evenly_spaced(total, num_frames):
        cap.set(cv2.CAP_PROP_POS_FRAMES, i)
        ok, frame = cap.read()
        if ok:
            ok, buf = cv2.imencode(".png", frame)
            if ok:
                out.append(bytes_to_data_url(buf.tobytes()))
    cap.release()
    return out


def _frames_with_pyav(path: Path, num_frames: int) -> list[str]:
    try:
        import av
    except ImportError:
        return []
    with av.open(str(path)) as container:
        frames = [f.to_image() for f in container.decode(video=0)]
    return [bytes_to_data_url(_pil_to_png_bytes(frames[i])) for i in _evenly_spaced(len(frames), num_frames)]
