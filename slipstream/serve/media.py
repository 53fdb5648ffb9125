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
import concurrent.futures
import dataclasses
import http.client
import math
import os
import socket
import stat
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
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

MEDIA_THREADS = 8
"""Threads that load a server's (or one `LLM.chat` call's) image URLs, one image each at a time: a
ninth image waits for one, so stalled fetches hold at most these threads, each until its
--media-fetch-timeout."""

PATH_MAX = 4096
"""The longest file path (Linux's PATH_MAX, in bytes) a file URL may name."""

_READ_BYTES = 2**16
_REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})
_PATH_SAFE = "/%:@!$&'()*+,;="
"""What `quote` leaves in a path besides letters, digits and `_.-~`: RFC 3986's path characters and
`%`, so that escapes already there stay as they are."""
_QUERY_SAFE = _PATH_SAFE + "?"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MediaConfig:
    """Which image URLs may be loaded, and how long and large a fetch may be."""

    allowed_media_domains: tuple[str, ...] | None = None
    """Hosts http(s) URLs may name (every redirect's too), compared exactly once lower-cased and
    without a trailing dot; None: any host. Set it on any server that untrusted clients reach."""
    allowed_local_media_path: str | None = None
    """The directory file URLs may name files under (symlinks and `..` resolved first); None: file
    URLs are refused."""
    fetch_timeout_s: float = FETCH_TIMEOUT_S
    """Seconds one fetch may take in all, resolving host names, redirects, headers and body
    included: at this deadline the fetch's connection is shut down (or its host name given up)."""
    max_image_bytes: int = MAX_IMAGE_BYTES

    def __post_init__(self) -> None:
        domains = self.allowed_media_domains
        if domains is not None:
            object.__setattr__(self, "allowed_media_domains", _host_names(domains))
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
        as its characters), the path a string or a path ("", vLLM's default, as None)."""
        if isinstance(allowed_media_domains, list):
            allowed_media_domains = tuple(allowed_media_domains)
        if isinstance(allowed_local_media_path, os.PathLike):
            allowed_local_media_path = os.fspath(allowed_local_media_path)
        if allowed_local_media_path == "":  # vLLM's default value: no file URLs
            allowed_local_media_path = None
        return cls(allowed_media_domains=allowed_media_domains,
                   allowed_local_media_path=allowed_local_media_path, fetch_timeout_s=fetch_timeout_s)


def _host_names(domains: Any) -> tuple[str, ...]:
    """`allowed_media_domains` normalised as URL hosts are compared: stripped, lower-cased, without
    a trailing dot; a ValueError unless it is a non-empty list of host names (no port, path, user or
    space in one)."""
    error = ValueError(f"allowed_media_domains (--allowed-media-domains) must be a non-empty list of host "
                       f"names, got {domains!r}")
    if not isinstance(domains, tuple) or not domains or not all(isinstance(d, str) for d in domains):
        raise error
    names = tuple(domain.strip().lower().rstrip(".") for domain in domains)
    if not all(name and not any(c in ":/@" or c.isspace() for c in name) for name in names):
        raise error
    return names


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
    """Hands 3xx answers back as HTTPErrors, so that `_fetch` checks each target itself (before
    urllib parses it: a Location that is no URL is refused as one)."""

    def http_error_302(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any) -> None:
        return None

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


class _Watchdog:
    """One fetch's deadline, enforced from a timer thread: when it passes, every socket the fetch
    opened is shut down, which wakes a read blocked on it (a socket's own timeout bounds each read,
    not a status line, headers or chunk sizes that trickle in a byte at a time)."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.fired = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> socket.socket:
        """`sock`, to be shut down at the deadline. A duplicate is kept: shutting it down shuts the
        shared connection even after TLS has wrapped (and detached) `sock`."""
        with self._lock:
            self._sockets.append(sock.dup())
            if self.fired:
                _shut_down(self._sockets[-1])
        return sock

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            for sock in self._sockets:
                _shut_down(sock)

    def close(self) -> None:
        """Stop the timer and close the duplicates (the connections themselves close with urllib's
        responses)."""
        self._timer.cancel()
        with self._lock:
            for sock in self._sockets:
                sock.close()
            self._sockets.clear()


def _shut_down(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed by its peer
        pass


def _watched(connection_class: type[http.client.HTTPConnection], watchdog: _Watchdog) -> Callable:
    """A factory of `connection_class` connections that resolve their host within `watchdog`'s
    deadline and whose sockets it shuts at that deadline."""
    def connection(*args: Any, **kwargs: Any) -> http.client.HTTPConnection:
        conn = connection_class(*args, **kwargs)
        conn._create_connection = lambda address, timeout, source_address=None: watchdog.watch(
            _connect(address, timeout, source_address, watchdog.deadline))
        return conn
    return connection


def _connect(address: tuple[str, int], timeout: float, source_address: tuple[str, int] | None,
             deadline: float) -> socket.socket:
    """A socket connected to `address` as `socket.create_connection` connects one (each address
    the host resolves to in turn, each attempt bounded by `timeout`), its host name resolved by
    `deadline`: the system's resolver takes no timeout, so it runs on a thread of its own, left to
    finish in the background when the deadline comes first."""
    host, port = address
    resolved: concurrent.futures.Future[list] = concurrent.futures.Future()

    def resolve() -> None:
        try:
            resolved.set_result(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except Exception as error:  # handed to the waiting fetch
            resolved.set_exception(error)

    threading.Thread(target=resolve, name="slipstream-media-resolve", daemon=True).start()
    try:
        addresses = resolved.result(timeout=max(0.0, deadline - time.monotonic()))
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"resolving {host!r} timed out") from None
    error: OSError | None = None
    for family, kind, proto, _, sockaddr in addresses:
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            if source_address is not None:
                sock.bind(source_address)
            sock.connect(sockaddr)
            return sock
        except OSError as e:
            sock.close()
            error = e
    raise error if error is not None else OSError(f"{host!r} resolved to no address")


class _WatchedHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, watchdog: _Watchdog) -> None:
        super().__init__()
        self._watchdog = watchdog

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_watched(http.client.HTTPConnection, self._watchdog), req)


class _WatchedHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, watchdog: _Watchdog) -> None:
        super().__init__()
        self._watchdog = watchdog

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_watched(http.client.HTTPSConnection, self._watchdog), req, context=self._context)


def _shown(text: str, limit: int = 200) -> str:
    """`text` (a URL, a path, a server's reason) as an error message shows it: cut short, as a
    request may send megabytes of it."""
    return text if len(text) <= limit else text[:limit] + "..."


def _fetch(url: str, where: str, media: MediaConfig) -> bytes:
    """The body at an http(s) URL, redirects followed to hosts that pass the same checks, all of it
    within `media.fetch_timeout_s` and `media.max_image_bytes`."""
    watchdog = _Watchdog(media.fetch_timeout_s)
    opener = urllib.request.build_opener(_NoRedirects, _WatchedHTTPHandler(watchdog),
                                         _WatchedHTTPSHandler(watchdog))
    try:
        for _ in range(MAX_REDIRECTS + 1):
            url = _checked_url(url, where, media)
            what = f"{where}: fetching {_shown(url)}"
            request = urllib.request.Request(url, headers={"User-Agent": "slipstream", "Accept": "image/*"})
            try:
                remaining_s = watchdog.deadline - time.monotonic()
                if remaining_s <= 0:
                    raise TimeoutError
                with opener.open(request, timeout=remaining_s) as response:
                    body = _read_body(response, what, media.max_image_bytes)
                if watchdog.fired:  # a body without a length ends when the watchdog shuts it
                    raise TimeoutError
                return body
            except urllib.error.HTTPError as error:
                url = _redirect_target(error, url, what, where)
            except (OSError, http.client.HTTPException, UnicodeError) as error:
                raise _fetch_error(TimeoutError() if watchdog.fired else error, what,
                                   media.fetch_timeout_s) from None
    finally:
        watchdog.close()
    raise ValueError(f"{where}: fetching the image took more than {MAX_REDIRECTS} redirects")


def _redirect_target(error: urllib.error.HTTPError, url: str, what: str, where: str) -> str:
    """The http(s) URL an HTTP error of `url` redirects to; a ValueError if it is no redirect."""
    with error:
        location = error.headers.get("Location") if error.code in _REDIRECT_CODES else None
    if location is None:
        raise ValueError(f"{what} gave HTTP {error.code} {_shown(str(error.reason), 100)}") from None
    try:
        target = urllib.parse.urljoin(url, location)
        scheme = urllib.parse.urlsplit(target).scheme
    except ValueError:
        raise ValueError(f"{what} redirected to {_shown(location)!r}, which is not a valid URL") from None
    if scheme not in ("http", "https"):
        raise ValueError(f"{where}: {_shown(target)!r}, a redirect's target, is not an http(s) URL") from None
    return target


def _fetch_error(error: Exception, what: str, timeout_s: float) -> ValueError:
    """The ValueError of a fetch (`what`) that failed with `error`; urllib wraps a timeout or a
    refused connection in a URLError."""
    reason = error.reason if isinstance(error, urllib.error.URLError) else error
    if isinstance(reason, TimeoutError):  # socket.timeout too
        return ValueError(f"{what} took longer than the {timeout_s:g} s media fetch timeout "
                          "(media_fetch_timeout_s, --media-fetch-timeout)")
    return ValueError(f"{what} failed ({type(reason).__name__}: {_shown(str(reason), 100)})")


def _checked_url(url: str, where: str, media: MediaConfig) -> str:
    """`url` with non-ASCII and other characters a request line cannot hold percent-encoded in its
    path and query (as browsers send them) and its fragment dropped; a ValueError unless it names
    a host (one of `allowed_media_domains` where those are set), a valid port, and no user or
    password."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (a ValueError unless a number from 0 to 65535)
    except ValueError as error:
        raise ValueError(f"{where}: {_shown(url)!r} is not a valid URL ({error})") from None
    if parts.username is not None:
        raise ValueError(f"{where}: {_shown(url)!r} names a user or password, which image URLs may not")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise ValueError(f"{where}: {_shown(url)!r} names no host")
    allowed = media.allowed_media_domains
    if allowed is not None and host not in allowed:
        raise ValueError(f"{where}: the host {host!r} is not one of the allowed media domains "
                         f"({', '.join(allowed)}; allowed_media_domains, --allowed-media-domains)")
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, urllib.parse.quote(parts.path, _PATH_SAFE),
                                    urllib.parse.quote(parts.query, _QUERY_SAFE), ""))


def _read_body(response: http.client.HTTPResponse, what: str, limit: int) -> bytes:
    """The response's body: `what` (where, and the URL) refused once the body is past `limit` bytes
    (from Content-Length when the server sends one)."""
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
    raise ValueError(f"{what} is more than the {limit} bytes an image may have")


def _read_file(url: str, where: str, media: MediaConfig) -> bytes:
    """The bytes of the regular file a file URL names, under `allowed_local_media_path` once
    symlinks and `..` are resolved, at most `max_image_bytes` of them."""
    if media.allowed_local_media_path is None:
        raise ValueError(f"{where}: file URLs are refused unless allowed_local_media_path "
                         "(--allowed-local-media-path) names a directory to read them from")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc.lower() not in ("", "localhost"):
        raise ValueError(f"{where}: a file URL must name a local path (file:///...), got host "
                         f"{_shown(parts.netloc)!r}")
    name = urllib.request.url2pathname(parts.path)
    if len(os.fsencode(name)) > PATH_MAX:
        raise ValueError(f"{where}: {_shown(name)!r} is longer than a file path may be ({PATH_MAX} bytes)")
    root = Path(media.allowed_local_media_path).resolve()
    try:
        path = Path(name).resolve()
    except (OSError, RuntimeError, ValueError) as error:  # a symlink loop, a NUL byte
        raise ValueError(f"{where}: cannot resolve {_shown(name)!r} ({error})") from None
    if not path.is_relative_to(root):
        raise ValueError(f"{where}: {_shown(str(path))} is not under the allowed local media path {root} "
                         "(allowed_local_media_path, --allowed-local-media-path)")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the open
    except OSError as error:
        raise ValueError(f"{where}: cannot read {_shown(str(path))} ({error.strerror})") from None
    try:
        _check_file(os.fstat(fd), f"{where}: {_shown(str(path))}", media.max_image_bytes)
        file = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with file:
        data = file.read(media.max_image_bytes + 1)
    if len(data) > media.max_image_bytes:
        raise ValueError(f"{where}: {_shown(str(path))} is more than the {media.max_image_bytes} bytes an "
                         "image may have")
    return data


def _check_file(info: os.stat_result, what: str, limit: int) -> None:
    """A ValueError naming `what` unless `info` is a regular file's of at most `limit` bytes."""
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{what} is not a regular file")
    if info.st_size > limit:
        raise ValueError(f"{what} is {info.st_size} bytes, more than the {limit} bytes an image may have")
