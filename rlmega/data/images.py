"""Images in prompt rows: content parts, where their bytes come from, and the checks made at load.

A chat prompt's message may hold a list of content parts instead of a string, as OpenAI's and Hugging
Face's chat formats write them:

    {"role": "user", "content": [{"type": "image", "image": "shapes/0001.png"},
                                 {"type": "text", "text": "How many circles?"}]}

An image part's source (``image``, or OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}``) is
- a file path (relative to the data file's folder, or absolute),
- a ``data:image/...;base64,...`` URI,
- an http(s) URL (fetched once, at load),
- bytes (a Parquet column of binary; or Hugging Face datasets' ``{"bytes": ..., "path": ...}``).
Each is read and decoded once at load (``load_image``): a missing file, an unreadable or corrupt image, or one
of more than ``max_pixels`` pixels is a bad row, named by file and row. The row keeps the encoded bytes
(``row["images"]``, in order) and its parts become ``{"type": "image"}`` placeholders for the chat template.

A row's sources are hostile input (issue 57): a row may name any path or URL. So (``ImageLimits``):
- a path must be a regular file (not /dev/zero, a FIFO or a folder): opened without blocking, checked by fstat;
- at most ``max_bytes`` are read from any source (data.max_image_bytes), and a data URI or bytes over it are
  refused before decoding;
- URLs are fetched only when data.image_urls allows it ("off" by default; "public": http(s) to public
  addresses; "any": loopback and private addresses too), each redirect checked the same way, within one
  deadline for the whole fetch (URL_DEADLINE_S), and named in messages without their query string (tokens).
  Under "public" the address checked is the address connected to (one lookup per connection, so a name that
  resolves to a public address when checked and a private one when fetched, DNS rebinding, is refused), and
  no proxy from the environment is used (a proxy would resolve and reach the host itself);
- Pillow opens only IMAGE_FORMATS (an EPS, say, would start Ghostscript).
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import ipaddress
import os
import re
import socket
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

IMAGE_TYPES = ("image", "image_url")
URL_DEADLINE_S = 30.0  # one fetch, redirects and all (checked between reads)
URL_READ_TIMEOUT_S = 5.0  # one read: so a fetch ends within URL_DEADLINE_S + this
# What vision-language processors take; Pillow tries no other plugin on a row's bytes.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
URL_POLICIES = ("off", "public", "any")


@dataclass(frozen=True)
class ImageLimits:
    """What a row's image may cost: pixels (data.max_image_pixels), bytes read (data.max_image_bytes), and whether
    URLs are fetched (data.image_urls: "off", "public", "any")."""

    max_pixels: int = 4096 * 4096
    max_bytes: int = 32 * 2**20
    urls: str = "off"


# data.*'s defaults (tests/unit/test_image_rows.py holds them equal)
DEFAULT_IMAGE_LIMITS = ImageLimits()


class BadImage(ValueError):
    """An image part that cannot be used; the message says what and the fix."""


def _source(part: dict) -> Any:
    if part["type"] == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    src = part.get("image")
    return src.get("bytes") or src.get("path") if isinstance(src, dict) else src


def read_source(source: Any, base_dir: str, limits: ImageLimits = DEFAULT_IMAGE_LIMITS) -> bytes:
    """The encoded bytes of an image part's source (see the module docstring), at most ``limits.max_bytes``."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _within(bytes(source), limits, "the image's bytes")
    if not isinstance(source, str) or not source:
        raise BadImage(
            f"an image part's source is {type(source).__name__}, not a path, URL, data URI or bytes. "
            'Fix: write {"type": "image", "image": "PATH_OR_URL"}'
        )
    if source.startswith("data:"):
        head, _, data = source.partition(",")
        if not head.endswith(";base64"):
            raise BadImage(
                f"data URI {source[:40]!r}... is not base64. Fix: write data:image/png;base64,<data>"
            )
        _within_size(len(data) * 3 // 4, limits, "the data URI's image")  # before decoding it
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise BadImage(
                f"data URI {source[:40]!r}... is not valid base64 ({e}). Fix: re-encode the image"
            ) from e
    # a URL, of any scheme: _fetch refuses all but http(s)
    if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*://", source):
        return _fetch(source, limits)
    path = source if os.path.isabs(source) else os.path.join(base_dir, source)
    return _read_file(path, limits)


def _within_size(size: int, limits: ImageLimits, what: str) -> None:
    if size > limits.max_bytes:
        raise BadImage(
            f"{what} is over data.max_image_bytes={limits.max_bytes} bytes. Fix: re-encode or resize "
            "it, or raise data.max_image_bytes"
        )


def _within(data: bytes, limits: ImageLimits, what: str) -> bytes:
    _within_size(len(data), limits, what)
    return data


def _read_file(path: str, limits: ImageLimits) -> bytes:
    """A regular file's bytes, at most limits.max_bytes: a device, FIFO or folder is refused without a blocking
    open or an unbounded read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise BadImage(
            f"image file {path} cannot be read ({e.strerror}). Fix: give a path relative to the data "
            "file's folder, or an absolute one"
        ) from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BadImage(
            f"image file {path} is not a regular file (a device, pipe or folder). Fix: give the path "
            "of an image file"
        )
    with os.fdopen(fd, "rb") as f:
        data = f.read(limits.max_bytes + 1)
    return _within(data, limits, f"image file {path}")


def _shown(url: str) -> str:
    """The URL as messages show it: scheme, host, port and path, without credentials, query string or fragment
    (tokens)."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:  # a port that is not a number
        port = ""
    return urllib.parse.urlunsplit(
        (parts.scheme, (parts.hostname or "") + port, parts.path, "", "")
    )


def _url_problem(url: str, limits: ImageLimits) -> str | None:
    """Why ``url`` may not be fetched under ``limits.urls``, or None."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return f"its scheme is {parts.scheme!r}; images are fetched over http(s) only"
    if not parts.hostname:
        return "it names no host"
    if limits.urls == "any":
        return None
    try:
        found = socket.getaddrinfo(parts.hostname, parts.port or 443, type=socket.SOCK_STREAM)
    except OSError as e:
        return f"its host does not resolve ({e})"
    return _addresses_problem(found)


def _addresses_problem(found: list) -> str | None:
    """Why getaddrinfo's answer ``found`` names an address data.image_urls=public refuses, or None."""
    for info in found:
        ip = ipaddress.ip_address(info[4][0].split("%")[0])
        if not ip.is_global:
            return (
                f"its host resolves to {ip}, a loopback, private or reserved address (set data.image_urls=any "
                "to allow those)"
            )
    return None


def _public_socket(host: str, port: int, timeout: float) -> socket.socket:
    """A connection to ``host`` at an address of the one lookup it checked (create_connection would look up
    again, and a rebinding name could answer otherwise the second time)."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    why = _addresses_problem(found)
    if why:
        raise BadImage(f"image host {host} is refused when connecting: {why}")
    error: OSError | None = None
    for family, kind, proto, _, address in found:
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            sock.connect(address)
            return sock
        except OSError as e:
            sock.close()
            error = e
    raise error or OSError(f"no address for {host}")


class _PublicHTTPConnection(http.client.HTTPConnection):
    def connect(self):
        self.sock = _public_socket(self.host, self.port, self.timeout)


class _PublicHTTPSConnection(http.client.HTTPSConnection):
    def connect(self):
        self.sock = self._context.wrap_socket(
            _public_socket(self.host, self.port, self.timeout), server_hostname=self.host
        )


class _PublicHTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req):
        return self.do_open(_PublicHTTPConnection, req)


class _PublicHTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req):
        return self.do_open(_PublicHTTPSConnection, req, context=self._context)


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    def __init__(self, limits: ImageLimits):
        self.limits = limits

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        why = _url_problem(newurl, self.limits)
        if why:
            raise BadImage(
                f"image URL {_shown(req.full_url)} redirects to {_shown(newurl)}, which is refused: {why}"
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(url: str, limits: ImageLimits) -> bytes:
    """An image URL's bytes: allowed by data.image_urls, redirects checked alike, at most limits.max_bytes, within
    URL_DEADLINE_S for the whole fetch."""
    if limits.urls == "off":
        raise BadImage(
            f"image URL {_shown(url)}: fetching URLs is off. Fix: set data.image_urls=public (or any, "
            "for loopback and private addresses), or store the image beside the data file"
        )
    why = _url_problem(url, limits)
    if why:
        raise BadImage(f"image URL {_shown(url)} is refused: {why}")
    deadline = time.monotonic() + URL_DEADLINE_S
    public = limits.urls == "public"  # connect to checked addresses only, and directly
    opener = urllib.request.build_opener(
        _CheckedRedirects(limits),
        *(
            (urllib.request.ProxyHandler({}), _PublicHTTPHandler(), _PublicHTTPSHandler())
            if public
            else ()
        ),
    )
    chunks, size = [], 0
    try:
        with opener.open(url, timeout=URL_READ_TIMEOUT_S) as r:
            while True:
                if time.monotonic() > deadline:
                    raise BadImage(
                        f"image URL {_shown(url)} took over {URL_DEADLINE_S:.0f} s. Fix: store the image "
                        "beside the data file"
                    )
                chunk = r.read1(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                _within_size(size, limits, f"image URL {_shown(url)}")
    except BadImage:
        raise
    except (OSError, urllib.error.URLError, ValueError) as e:
        raise BadImage(
            f"image URL {_shown(url)} could not be fetched ({type(e).__name__}). Fix: check the URL, or "
            "store the image next to the data file and give its path"
        ) from e
    return b"".join(chunks)


def check_image(data: bytes, max_pixels: int) -> tuple[int, int]:
    """(width, height) of an encoded image, decoded whole; BadImage when it is corrupt, of a format outside
    IMAGE_FORMATS, or over ``max_pixels``."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as img:
            width, height = img.size
            # before decoding: a huge image is refused without being held
            if width * height > max_pixels:
                raise BadImage(
                    f"image of {width}x{height} = {width * height} pixels is over "
                    f"data.max_image_pixels={max_pixels}. Fix: resize it, or raise data.max_image_pixels"
                )
            img.load()
    except BadImage:
        raise
    except Exception as e:  # PIL's UnidentifiedImageError, truncated files, decompression bombs
        raise BadImage(
            f"image is not readable as {', '.join(IMAGE_FORMATS)} ({type(e).__name__}: {str(e)[:120]}). "
            "Fix: re-save it as PNG or JPEG"
        ) from e
    return width, height


def load_image(source: Any, base_dir: str, limits: ImageLimits) -> bytes:
    """An image part's source -> its encoded bytes, checked (``check_image``)."""
    data = read_source(source, base_dir, limits)
    check_image(data, limits.max_pixels)
    return data


def split_images(messages: list, base_dir: str, limits: ImageLimits) -> tuple[list, list[bytes]]:
    """(messages with each image part as ``{"type": "image"}``, the images' bytes in order). A message whose
    content is a string is kept as it is. BadImage / ValueError name the message and part."""
    out, images = [], []
    for i, m in enumerate(messages):
        content = m["content"]
        if isinstance(content, str):
            out.append(dict(m))
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"message {i}, part {j}"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise ValueError(
                        f"{where}: a text part needs a string 'text'. Fix: "
                        '{"type": "text", "text": "..."}'
                    )
                parts.append({"type": "text", "text": part["text"]})
            elif kind in IMAGE_TYPES:
                try:
                    images.append(load_image(_source(part), base_dir, limits))
                except BadImage as e:
                    raise BadImage(f"{where}: {e}") from e
                parts.append({"type": "image"})
            else:
                raise ValueError(
                    f"{where} is {str(part)[:60]}: a content part is "
                    '{"type": "text", "text": ...} or {"type": "image", "image": PATH_OR_URL}'
                )
        out.append({**m, "content": parts})
    return out, images


def decode_images(images: list[bytes]) -> list:
    """Encoded image files -> PIL images, as processors and vLLM's multi-modal requests take them (each
    converts to RGB itself)."""
    from PIL import Image

    out = []
    for data in images:
        img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        img.load()  # read now, not lazily later
        out.append(img)
    return out


def is_vlm_folder(path: str) -> bool:
    """Whether the model folder's config.json describes a vision-language model (it has a ``vision_config``)."""
    import json

    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("vision_config") is not None
    except (OSError, ValueError):
        return False


def load_processor(path: str):
    """A vision-language model folder's processor (transformers' AutoProcessor: chat template, tokenizer and
    image processor), or None for a text-only model."""
    if not is_vlm_folder(path):
        return None
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


# What a processor returns besides the images' own tensors (the tokens are the prompt's)
_TOKEN_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def processor_vision(processor, text: str, images) -> tuple[dict, list[int]]:
    """(the processor's image tensors for the trainer: pixel_values and the family's layout, the expanded token ids)
    of a rendered prompt ``text`` with its ``images`` (encoded files)."""
    import torch

    enc = processor(
        text=[text],
        images=[decode_images(list(images))],
        add_special_tokens=False,
        return_tensors="pt",
    )
    vision = {k: v for k, v in enc.items() if k not in _TOKEN_KEYS and isinstance(v, torch.Tensor)}
    return vision, [int(t) for t in enc["input_ids"][0]]
