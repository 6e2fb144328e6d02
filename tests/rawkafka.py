"""A raw Kafka Produce request (v3, one v2 record batch, acks=1), for records no client library would write:
header keys that are not UTF-8, for one. Pure sockets and struct; the partition leader comes from metadata."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Sequence

from confluent_kafka.admin import AdminClient  # type: ignore[attr-defined]


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli polynomial, reflected
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum of a v2 record batch."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC32C[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _varint(n: int) -> bytes:
    z = (n << 1) ^ (n >> 63)  # zigzag
    out = bytearray()
    while True:
        if z < 0x80:
            out.append(z)
            return bytes(out)
        out.append((z & 0x7F) | 0x80)
        z >>= 7


def _field(data: bytes | None) -> bytes:
    return _varint(-1) if data is None else _varint(len(data)) + data


def record_batch(key: bytes | None, value: bytes | None, headers: Sequence[tuple[bytes, bytes]]) -> bytes:
    """A v2 record batch holding one record; header keys and values are written as given."""
    now = int(time.time() * 1000)
    body = b"\x00" + _varint(0) + _varint(0) + _field(key) + _field(value) + _varint(len(headers))
    body += b"".join(_field(k) + _field(v) for k, v in headers)
    record = _varint(len(body)) + body
    # attributes, lastOffsetDelta, base/max timestamp, producer id/epoch, base sequence, record count
    after_crc = struct.pack(">hiqqqhii", 0, 0, now, now, -1, -1, -1, 1) + record
    crc = struct.pack(">I", crc32c(after_crc))
    tail = struct.pack(">ib", -1, 2) + crc + after_crc  # partition leader epoch, magic 2
    return struct.pack(">qi", 0, len(tail)) + tail  # base offset, batch length


def _string(s: str) -> bytes:
    data = s.encode()
    return struct.pack(">h", len(data)) + data


def _leader(bootstrap: str, topic: str, partition: int) -> tuple[str, int]:
    md = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=10)
    leader = md.topics[topic].partitions[partition].leader
    broker = md.brokers[leader]
    return broker.host, broker.port


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the broker closed the connection")
        data += chunk
    return data


def produce_raw(
    bootstrap: str,
    topic: str,
    partition: int,
    *,
    key: bytes | None,
    value: bytes | None,
    headers: Sequence[tuple[bytes, bytes]],
) -> int:
    """Write one record with these exact bytes to the partition's leader (acks=1); returns its offset."""
    records = record_batch(key, value, headers)
    body = struct.pack(">hhi", -1, 1, 10_000)  # no transactional id, acks=1, timeout ms
    body += struct.pack(">i", 1) + _string(topic)
    body += struct.pack(">i", 1) + struct.pack(">i", partition) + struct.pack(">i", len(records)) + records
    request = struct.pack(">hhi", 0, 3, 1) + _string("taskq-tests-raw") + body  # Produce v3, correlation 1
    with socket.create_connection(_leader(bootstrap, topic, partition), timeout=10) as sock:
        sock.sendall(struct.pack(">i", len(request)) + request)
        (size,) = struct.unpack(">i", _recv(sock, 4))
        response = _recv(sock, size)
    # correlation id, topics [name, partitions [index, error code, base offset, ...]]
    pos = 4 + 4
    (name_len,) = struct.unpack_from(">h", response, pos)
    pos += 2 + name_len + 4
    _, error, offset = struct.unpack_from(">ihq", response, pos)
    if error:
        raise RuntimeError(f"Produce to {topic}[{partition}] failed with error code {error}")
    return int(offset)
