"""Image URLs turned into PIL images: data URLs decoded, http(s) URLs fetched with the standard
library, file URLs read from one allowed directory (vLLM's MediaConnector, with its settings'
names: --allowed-media-domains, --allowed-local-media-path, VLLM_IMAGE_FETCH_TIMEOUT).

A server that fetches URLs its clients name can be made to request addresses only it can reach
(server-side request forgery), so every hop of a fetch is checked: the scheme, the host against
`allowed_media_domains` where set (redirects are followed by hand, each target checked as the
first URL was), the time against one deadline for the whole fetch, and the body's size. Every
failure is a ValueError naming where in the request the URL was and what went wrong, which the
server answers as a 400.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import http.client
import math
import os
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import PIL.Image

from slipstream.model.image_processor import decode_image

MAX_IMAGE_BYTES = 32 * 2**20
"""The most bytes a fetched or read image may have: a lossless 4K PNG (3840 x 2160 RGB, about 25
MB at worst) or a camera's JPEG fits; past it, a URL cannot make the server hold an unbounded
download in memory. Pixels are bounded apart from this, at decoding (Pillow's MAX_IMAGE_PIXELS)."""

MAX_REDIRECTS = 5
"""Redirect hops a fetch follows (browsers allow about 20; an image host needs one or two)."""

FETCH_TIMEOUT_S = 5.0
"""vLLM's default VLLM_IMAGE_FETCH_TIMEOUT."""

_READ_BYTES = 2**16
_REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MediaConfig:
    """Which image URLs may be loaded, and how long and large a fetch may be."""

    allowed_media_domains: tuple[str, ...] | None = None
    """Hosts http(s) URLs may name (every redirect's too), compared exactly, case aside; None: any
    host. Set it on any server that untrusted clients reach."""
    allowed_local_media_path: str | None = None
    """The directory file URLs may name files under (symlinks and `..` resolved first); None: file
    URLs are refused."""
    fetch_timeout_s: float = FETCH_TIMEOUT_S
    """Seconds one fetch may take in all, redirects and body included: checked between reads, and a
    single read waits at most what was left when its connection opened, so a fetch ends within
    twice this."""
    max_image_bytes: int = MAX_IMAGE_BYTES

    def __post_init__(self) -> None:
        domains = self.allowed_media_domains
        if domains is not None and (not isinstance(domains, tuple) or not domains or not all(
                isinstance(domain, str) and domain.strip() for domain in domains)):
            raise ValueError(f"allowed_media_domains (--allowed-media-domains) must be a non-empty list of "
                             f"host names, got {domains!r}")
        path = self.allowed_local_media_path
        if path is not None and not (isinstance(path, str) and Path(path).is_dir()):
            raise ValueError(f"allowed_local_media_path (--allowed-local-media-path) must be an existing "
                             f"directory, got {path!r}")
        timeout = self.fetch_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ValueError(f"media_fetch_timeout_s (--media-fetch-timeout) must be a number of seconds "
                             f"> 0, got {timeout!r}")
        if isinstance(self.max_image_bytes, bool) or not isinstance(self.max_image_bytes, int) or (
                self.max_image_bytes < 1):
            raise ValueError(f"max_image_bytes must be a positive integer, got {self.max_image_bytes!r}")

    @classmethod
    def from_args(cls, allowed_media_domains: Any = None, allowed_local_media_path: Any = None,
                  fetch_timeout_s: Any = FETCH_TIMEOUT_S) -> MediaConfig:
        """From `LLM`'s or the CLI's values: the domains a list (a lone string is refused, not read
        as its characters), the path a string or a path."""
        if isinstance(allowed_media_domains, list):
            allowed_media_domains = tuple(allowed_media_domains)
        if isinstance(allowed_local_media_path, os.PathLike):
            allowed_local_media_path = os.fspath(allowed_local_media_path)
        return cls(allowed_media_domains=allowed_media_domains,
                   allowed_local_media_path=allowed_local_media_path, fetch_timeout_s=fetch_timeout_s)


def load_image(url: Any, where: str, media: MediaConfig) -> PIL.Image.Image:
    """The image a data, http(s) or file URL names, decoded (`decode_image`'s checks); anything
    that fails is a ValueError naming `where`."""
    if not isinstance(url, str):
        raise ValueError(f"{where} must be a string (a data, http(s) or file URL), got {url!r}")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_url_bytes(url, where)
    elif scheme in ("http", "https"):
        data = _fetch(url, where, media)
    elif scheme == "file":
        data = _read_file(url, where, media)
    else:
        raise ValueError(f"{where}: image URLs are data, http, https or file URLs, got "
                         f"{scheme or url[:20]!r}")
    return decode_image(data, where)


def _data_url_bytes(url: str, where: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError(f"{where}: a data URL must be base64-encoded (data:image/...;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{where}: invalid base64 in the data URL ({e})") from None


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Hands 3xx answers back as HTTPErrors, so that `_fetch` checks each target itself."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


def _shown(url: str) -> str:
    """`url` as an error message shows it: cut short, as a request may send megabytes of it."""
    return url if len(url) <= 200 else url[:200] + "..."


def _fetch(url: str, where: str, media: MediaConfig) -> bytes:
    """The body at an http(s) URL, redirects followed to hosts that pass the same checks, all of it
    within `media.fetch_timeout_s` and `media.max_image_bytes`."""
    deadline = time.monotonic() + media.fetch_timeout_s
    for _ in range(MAX_REDIRECTS + 1):
        _check_host(url, where, media)
        shown = _shown(url)
        request = urllib.request.Request(url, headers={"User-Agent": "slipstream", "Accept": "image/*"})
        try:
            if time.monotonic() >= deadline:
                raise TimeoutError
            with _OPENER.open(request, timeout=deadline - time.monotonic()) as response:
                return _read_body(response, f"{where}: {shown}", media.max_image_bytes, deadline)
        except urllib.error.HTTPError as error:
            with error:
                location = error.headers.get("Location") if error.code in _REDIRECT_CODES else None
            if location is None:
                raise ValueError(f"{where}: fetching {shown} gave HTTP {error.code} {error.reason}") from None
            url = urllib.parse.urljoin(url, location)
            if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
                raise ValueError(f"{where}: {_shown(url)!r}, a redirect's target, is not an http(s) "
                                 "URL") from None
        except (TimeoutError, urllib.error.URLError, OSError, http.client.HTTPException) as error:
            raise _fetch_error(error, f"{where}: fetching {shown}", media.fetch_timeout_s) from None
    raise ValueError(f"{where}: fetching the image took more than {MAX_REDIRECTS} redirects")


def _fetch_error(error: Exception, what: str, timeout_s: float) -> ValueError:
    """The ValueError of a fetch (`what`) that failed with `error`; urllib wraps a timeout or a
    refused connection in a URLError."""
    reason = error.reason if isinstance(error, urllib.error.URLError) else error
    if isinstance(reason, TimeoutError):  # socket.timeout too
        return ValueError(f"{what} took longer than the {timeout_s:g} s media fetch timeout "
                          "(--media-fetch-timeout)")
    return ValueError(f"{what} failed ({type(reason).__name__}: {reason})")


def _check_host(url: str, where: str, media: MediaConfig) -> None:
    """A ValueError unless `url` names a host, one of `allowed_media_domains` where those are set."""
    try:
        host = urllib.parse.urlsplit(url).hostname
    except ValueError as error:
        raise ValueError(f"{where}: {_shown(url)!r} is not a valid URL ({error})") from None
    if not host:
        raise ValueError(f"{where}: {_shown(url)!r} names no host")
    allowed = media.allowed_media_domains
    if allowed is not None and host not in {domain.lower() for domain in allowed}:
        raise ValueError(f"{where}: the host {host!r} is not one of the allowed media domains "
                         f"({', '.join(allowed)}; --allowed-media-domains)")


def _read_body(response: http.client.HTTPResponse, what: str, limit: int, deadline: float) -> bytes:
    """The response's body: `what` (where, and the URL) refused once the body is past `limit` bytes
    (from Content-Length when the server sends one), a TimeoutError once the deadline passes
    between reads (a server that trickles)."""
    length = response.headers.get("Content-Length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ValueError(f"{what} is {int(length)} bytes, more than the {limit} bytes an image may have")
    chunks, size = [], 0
    while size <= limit:
        chunk = response.read1(min(_READ_BYTES, limit + 1 - size))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if time.monotonic() > deadline:
            raise TimeoutError
    raise ValueError(f"{what} is more than the {limit} bytes an image may have")


def _read_file(url: str, where: str, media: MediaConfig) -> bytes:
    """The bytes of the regular file a file URL names, under `allowed_local_media_path` once
    symlinks and `..` are resolved, at most `max_image_bytes` of them."""
    if media.allowed_local_media_path is None:
        raise ValueError(f"{where}: file URLs are refused unless allowed_local_media_path "
                         "(--allowed-local-media-path) names a directory to read them from")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"{where}: a file URL must name a local path (file:///...), got host "
                         f"{parts.netloc!r}")
    root = Path(media.allowed_local_media_path).resolve()
    path = Path(urllib.request.url2pathname(parts.path)).resolve()
    if not path.is_relative_to(root):
        raise ValueError(f"{where}: {path} is not under the allowed local media path {root} "
                         "(--allowed-local-media-path)")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the open
    except OSError as error:
        raise ValueError(f"{where}: cannot read {path} ({error.strerror})") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{where}: {path} is not a regular file")
        if info.st_size > media.max_image_bytes:
            raise ValueError(f"{where}: {path} is {info.st_size} bytes, more than the "
                             f"{media.max_image_bytes} bytes an image may have")
        data = file.read(media.max_image_bytes + 1)
    if len(data) > media.max_image_bytes:
        raise ValueError(f"{where}: {path} is more than the {media.max_image_bytes} bytes an image may have")
    return data
