"""The bytes of canaryd's exposition, apart from what the series mean (`canaryd.daemon.metrics`): label
values bounded so that no server's odd string can bloat or break a scrape, the per-pair families rendered
by hand (the bulk of every scrape at 10,000 pairs), and one gzip member per scrape built from blocks
compressed once per pass."""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.utils import floatToGoString

from canaryd.daemon.metric_table import PAIR_FAMILIES
from canaryd.observation import storable

MARK = "…"  # where a label value too long for its series was cut
HASH_CHARS = 10  # hex digits of the whole value's hash kept after the mark: two long values stay distinct
EOF = b"# EOF\n"  # OpenMetrics' last line
GZIP_LEVEL = 6  # zlib's default: a few times faster than gzip's 9, barely larger
GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # deflate, no name, no mtime, OS unknown


def digest(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()


def bounded(value: str, limit: int) -> str:
    """``value`` as a label value of at most ``limit`` characters (limit ≥ 16): a longer one is cut to its
    first characters (three quarters of the limit at most), the mark and a hash of the whole value. Text
    UTF-8 cannot encode is escaped, so one odd value can never break the exposition."""
    value = storable(value)
    if len(value) <= limit:
        return value
    head = max(0, min(limit * 3 // 4, limit - len(MARK) - HASH_CHARS))
    return value[:head] + MARK + digest(value)[:HASH_CHARS]


def escape(value: str) -> str:
    """A label value as the exposition formats quote it (as prometheus_client does)."""
    return storable(value).replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


@dataclass(slots=True)
class Pair:
    """The last probe of one canary × backend; None = not known (no series)."""

    backend: str
    canary: str
    labels: str  # the escaped label pairs, rendered once
    verdict: str | None = None
    success: float | None = None
    delta: float | None = None
    last_probe: float | None = None


def _deflate(data: bytes, final: bool) -> bytes:
    """Raw deflate blocks of ``data``: sync-flushed (more blocks may follow) or final."""
    z = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, -zlib.MAX_WBITS)
    return z.compress(data) + z.flush(zlib.Z_FINISH if final else zlib.Z_SYNC_FLUSH)


@dataclass(frozen=True)
class Tail:
    """The per-pass end of a body, plain and as final deflate blocks compressed once per pass."""

    plain: bytes
    deflated: bytes

    @classmethod
    def of(cls, plain: bytes) -> Tail:
        return cls(plain, _deflate(plain, final=True))

    def after(self, head: bytes, gzipped: bool) -> bytes:
        """``head`` + this tail, as ONE gzip member when ``gzipped``: many clients (Python's zlib-based
        ones among them) read only the first member of a multi-member body. Only the small head is
        compressed per scrape; the CRC covers the whole body (zlib.crc32 runs at GB/s)."""
        if not gzipped:
            return head + self.plain
        crc = zlib.crc32(self.plain, zlib.crc32(head))
        size = (len(head) + len(self.plain)) & 0xFFFFFFFF
        return GZIP_HEADER + _deflate(head, final=False) + self.deflated + struct.pack("<II", crc, size)


@dataclass(frozen=True)
class Cache:
    """The per-pass part of the exposition in both formats (a scrape puts the live part before it)."""

    text: Tail
    openmetrics: Tail


EMPTY = Cache(Tail.of(b""), Tail.of(EOF))  # before the first pass


def render_pairs(pairs: Iterable[Pair]) -> bytes:
    """The pair families by hand: prometheus_client's generic writer costs ~20 µs a series, this ~1."""
    out: list[str] = []
    g = floatToGoString
    for f in PAIR_FAMILIES:
        name, attr = f.name, f.attr
        out.append(f"# HELP {name} {f.help}\n# TYPE {name} {f.type}\n")
        if attr == "verdict":
            out += [f'{name}{{{p.labels},verdict="{p.verdict}"}} 1.0\n' for p in pairs if p.verdict]
        else:
            out += [f"{name}{{{p.labels}}} {g(v)}\n" for p in pairs if (v := getattr(p, attr)) is not None]
    return "".join(out).encode()
