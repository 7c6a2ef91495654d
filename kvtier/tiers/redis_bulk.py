"""Bulk block reads from Redis that land straight in the host tier's buffers.

redis-py (even with hiredis) parses every reply into a new ``bytes`` object, and a pipeline of large
replies is slower still (its read buffer is re-copied as it grows): about 0.3 GB/s for blocks of
0.7 MB on loopback. The remote tier's loads are the one place that moves gigabytes, so they skip the
parser: the commands of a batch go out in one ``sendall`` (pipelined) and each bulk reply of the
expected size is received with ``recv_into`` in two parts, the 4 KiB block header into a scratch
buffer and the payload directly into the caller's ``out`` view. Nothing is copied in user space; the
caller validates header and payload (checksums, MAC) before the bytes count as loaded.

Reads are bounded before anything is allocated: a value is asked for with ``GETRANGE name 0 n``, so
whatever sits under a block key (a 300 MB value written by anyone who can reach the store), at most
one byte more than the block's size comes back, and a longer value is reported as ``Oversized``
without being read whole.

Connections come from a bounded pool (``max_connections``, waiting at most ``timeout_s`` for one); every
socket operation has ``timeout_s``. A connection that failed mid-reply is closed, never reused. URLs
are parsed by redis-py (``redis://[[user]:password@]host:port/db``, ``rediss://`` for TLS with optional
``?ssl_cert_reqs=none``, ``unix:///path?db=N``), so both clients reach the same server the same way.
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Sequence

from redis.connection import SSLConnection, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

_CHUNK = 1 << 16


def pack_command(*args: bytes) -> bytes:
    """One command in RESP (an array of bulk strings)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(out)


class _Stream:
    """A socket with a small read-ahead buffer: lines through the buffer, bulk data ``recv_into``."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()

    def readline(self) -> bytes:
        while True:
            end = self._buf.find(b"\r\n")
            if end >= 0:
                line = bytes(self._buf[:end])
                del self._buf[: end + 2]
                return line
            chunk = self.sock.recv(_CHUNK)
            if not chunk:
                raise RedisConnectionError("the server closed the connection")
            self._buf += chunk

    def readinto(self, out: memoryview) -> None:
        """Fill ``out`` exactly: read-ahead bytes first, then straight from the socket."""
        n = min(len(self._buf), out.nbytes)
        if n:
            out[:n] = self._buf[:n]
            del self._buf[:n]
        while n < out.nbytes:
            got = self.sock.recv_into(out[n:])
            if not got:
                raise RedisConnectionError("the server closed the connection mid-reply")
            n += got


class BulkReader:
    """Pipelined bounded reads (``GETRANGE`` + ``EXPIRE``), replies landing in the caller's buffers."""

    def __init__(self, url: str, *, timeout_s: float, max_connections: int = 2) -> None:
        self.options = parse_url(url)
        self.timeout_s = timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._idle: list[_Stream] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------ connections
    def _connect(self) -> _Stream:
        o = self.options
        if "path" in o:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            sock.connect(o["path"])
        else:
            host = o.get("host", "localhost")
            sock = socket.create_connection((host, int(o.get("port", 6379))), timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if o.get("connection_class") is SSLConnection:
                context = ssl.create_default_context()
                if o.get("ssl_cert_reqs") in ("none", ssl.CERT_NONE):
                    context.check_hostname = False
                    context.verify_mode = ssl.CERT_NONE
                sock = context.wrap_socket(sock, server_hostname=host)
        stream = _Stream(sock)
        try:
            if o.get("password") is not None:
                user = [o["username"].encode()] if o.get("username") else []
                self._expect_ok(stream, pack_command(b"AUTH", *user, o["password"].encode()))
            if int(o.get("db", 0)):
                self._expect_ok(stream, pack_command(b"SELECT", str(o["db"]).encode()))
        except BaseException:
            sock.close()
            raise
        return stream

    @staticmethod
    def _expect_ok(stream: _Stream, command: bytes) -> None:
        stream.sock.sendall(command)
        line = stream.readline()
        if not line.startswith(b"+"):
            raise ResponseError(line.decode("utf-8", "replace"))

    def _acquire(self) -> _Stream:
        if not self._slots.acquire(timeout=self.timeout_s):
            raise RedisConnectionError("no free connection to the remote store")
        with self._lock:
            if self._idle:
                return self._idle.pop()
        try:
            return self._connect()
        except BaseException:
            self._slots.release()
            raise

    def _release(self, stream: _Stream, reusable: bool) -> None:
        if reusable:
            with self._lock:
                self._idle.append(stream)
        else:
            stream.sock.close()
        self._slots.release()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for stream in idle:
            stream.sock.close()

    # ------------------------------------------------------------------------ reads
    def get_many(
        self, names: Sequence[bytes], ttl_s: int, heads: Sequence[memoryview], outs: Sequence[memoryview]
    ) -> list[BulkResult]:
        """Read every name's value, bounded, in one round trip: ``GETRANGE name 0 n`` (``n`` =
        ``heads[i].nbytes + outs[i].nbytes``, so at most ``n + 1`` bytes ever come back, whatever the
        store holds) then ``EXPIRE name ttl_s`` (``EXISTS`` if 0: is it there at all).

        ==================  ==========================================================================
        the value holds     result
        ==================  ==========================================================================
        exactly n bytes     ``n``: the bytes landed in ``heads[i]`` then ``outs[i]``
        more than n bytes   ``Oversized(n + 1)``: its first n bytes landed there too, the rest unread
        1..n-1 bytes        a bytearray of them (for the caller to diagnose)
        nothing (no key)    None
        an error reply      a ``ResponseError`` (e.g. WRONGTYPE)
        ==================  ==========================================================================

        A broken connection raises."""
        refresh = [b"EXPIRE", b"%d" % ttl_s] if ttl_s else [b"EXISTS"]
        payload = b"".join(
            pack_command(b"GETRANGE", name, b"0", b"%d" % (head.nbytes + out.nbytes))
            + pack_command(refresh[0], name, *refresh[1:])
            for name, head, out in zip(names, heads, outs, strict=False)
        )
        stream = self._acquire()
        ok = False
        try:
            stream.sock.sendall(payload)
            results = [self._reply(stream, head, out) for head, out in zip(heads, outs, strict=True)]
            ok = True
            return results
        finally:
            self._release(stream, ok)

    @staticmethod
    def _reply(stream: _Stream, head: memoryview, out: memoryview) -> BulkResult:
        """The replies of one name: GETRANGE's bulk string, then EXPIRE's (or EXISTS') integer."""
        line = stream.readline()
        if line.startswith(b"-"):
            result: BulkResult = ResponseError(line[1:].decode("utf-8", "replace"))
        elif line.startswith(b"$") and 0 <= int(line[1:]) <= head.nbytes + out.nbytes + 1:
            result = _receive(stream, int(line[1:]), head, out)
        else:
            raise RedisConnectionError(f"unexpected reply {line[:40]!r}")
        there = stream.readline()
        if not there.startswith((b":", b"-")):
            raise RedisConnectionError(f"unexpected reply {there[:40]!r}")
        if there == b":0" and not result:
            return None  # GETRANGE of a missing key is an empty string: EXPIRE/EXISTS tells them apart
        return result


class Oversized(int):
    """A value longer than the reader expected (at least this many bytes); only a bounded prefix was
    received."""


BulkResult = int | Oversized | bytearray | Exception | None


def _receive(stream: _Stream, size: int, head: memoryview, out: memoryview) -> BulkResult:
    """Receive one bulk string of ``size`` bytes (at most ``head + out + 1``) and its end of line."""
    expected = head.nbytes + out.nbytes
    if size >= expected:
        stream.readinto(head)
        stream.readinto(out)
        if size > expected:
            stream.readinto(memoryview(bytearray(size - expected)))
        result: BulkResult = Oversized(size) if size > expected else size
    else:
        result = bytearray(size)
        stream.readinto(memoryview(result))
    if stream.readline() != b"":
        raise RedisConnectionError("a bulk reply did not end where its length said")
    return result
