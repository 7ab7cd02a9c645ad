"""A stand-in for dead ranks in a gloo communicator's making (`StandIn`).

Why: a survivor that makes a communicator over a device set holding a dead process's devices
waits for every rank's rendezvous entry for gloo's 30 s. Writing an entry gloo refuses for each
dead rank (`collectives.DEAD_RANK`) ends that wait with gloo's own error, but only where every
live rank then fails before connecting any pair or after connecting all live ones
(`collectives.end_rendezvous`). Where a dead rank lies between live ones, the live rank below it
failed after connecting the ranks before it, and the one above waited for a connection from it
that never came, for gloo's connect timeout (150 s).

A stand-in removes the refusal from the middle of the pairs' connects: its entry points at a
socket of this process that completes gloo's connection handshake for the dead rank, so every
live rank connects every pair, the dead one included, and the communicator is made on every
survivor. Once every live rank has made its pair with it (`SETTLE_S` later), the stand-in
closes those connections: a survivor's pair with the dead rank reads the end at once, and a
collective over it fails with gloo's "connection closed"; the other survivors' waits are ended
by their own shutdown once quiet (`aborts.CollectiveAborts`, after `<clique>/stood-in`).

The handshake, as gloo's TCP transport makes it (gloo/transport/tcp/context.cc, device.cc,
listener.cc): every rank publishes (size_t hostname size, hostname, size_t address size,
address, one ssize_t pair id per rank), the address being (sockaddr_storage, ssize_t seq). For a
pair, the side whose (IP, port as stored, seq) compares greater connects to the other's
listening address and writes the 8-byte sequence number the other expects (the pair id the
other published for it, or its own rank where the pair ids are left out); the other side waits
for a connection that brings it. So the stand-in listens (for survivors that connect) and
connects to each survivor that waits, writing the number that survivor published for the dead
rank. Checked on the JAX the suite runs and on the newest by
tests/test_multiprocess.py::test_a_dead_rank_between_live_ones_is_stood_in_for.
"""

from __future__ import annotations

import dataclasses
import socket
import struct
import threading
from collections.abc import Callable

HOSTNAME = b"elasjax-dead-rank"  # a stand-in's entry (`is_stand_in`)
_SS_SIZE = 128  # sizeof(struct sockaddr_storage) on Linux
_SIZE = struct.calcsize("=Q")
_SEQ = struct.Struct("=q")


@dataclasses.dataclass(frozen=True)
class Entry:
    """A rank's rendezvous entry: its host name, its device's listening address (family, IP,
    port) and the pair ids it published (empty: gloo numbers pairs by rank)."""

    hostname: bytes
    family: int
    ip: str
    port: int
    pair_ids: tuple[int, ...]

    def seq_for(self, rank: int) -> int:
        """The sequence number this rank waits for from `rank`'s connection."""
        return self.pair_ids[rank] if self.pair_ids else rank


def parse(raw: bytes) -> Entry | None:
    """A rank's entry (gloo's `tcp::Rank`), or None where it is not an IPv4/IPv6 one of this
    layout (a refusing `DEAD_RANK` among them)."""
    try:
        (hn,) = struct.unpack_from("=Q", raw, 0)
        hostname = raw[_SIZE:_SIZE + hn]
        off = _SIZE + hn
        (an,) = struct.unpack_from("=Q", raw, off)
        addr = raw[off + _SIZE:off + _SIZE + an]
        rest = raw[off + _SIZE + an:]
        if an != _SS_SIZE + _SEQ.size or len(addr) != an or len(rest) % _SEQ.size:
            return None
        family = struct.unpack_from("=H", addr, 0)[0]
        if family == socket.AF_INET:
            port = struct.unpack_from("!H", addr, 2)[0]
            ip = socket.inet_ntop(socket.AF_INET, addr[4:8])
        elif family == socket.AF_INET6:
            port = struct.unpack_from("!H", addr, 2)[0]
            ip = socket.inet_ntop(socket.AF_INET6, addr[8:24])
        else:
            return None
        ids = tuple(_SEQ.unpack_from(rest, i)[0] for i in range(0, len(rest), _SEQ.size))
        return Entry(bytes(hostname), family, ip, port, ids)
    except (struct.error, ValueError, OSError):
        return None


def is_stand_in(raw: bytes) -> bool:
    e = parse(raw)
    return e is not None and e.hostname == HOSTNAME


def _sockaddr(family: int, ip: str, port: int) -> bytes:
    ss = bytearray(_SS_SIZE)
    struct.pack_into("=H", ss, 0, family)
    struct.pack_into("!H", ss, 2, port)
    if family == socket.AF_INET:
        ss[4:8] = socket.inet_pton(socket.AF_INET, ip)
    else:
        ss[8:24] = socket.inet_pton(socket.AF_INET6, ip)
    return bytes(ss)


def _key(family: int, ip: str, port: int) -> tuple[bytes, int]:
    """What gloo compares to choose the connecting side (`Device::isInitiator`): the IP's
    bytes, then the port as stored (network byte order read as a native uint16)."""
    raw_port = struct.unpack("=H", struct.pack("!H", port))[0]
    return socket.inet_pton(family, ip), raw_port


def _connects(a: tuple[bytes, int], a_seq: int, b: tuple[bytes, int], b_seq: int) -> bool:
    """gloo's `isInitiator(local=a, remote=b)`: a's IP bytes compared first, then the ports'
    difference, then the sequence numbers'; a connects when that is positive."""
    if a[0] != b[0]:
        return a[0] > b[0]
    if a[1] != b[1]:
        return a[1] > b[1]
    return a_seq > b_seq


# after a stand-in's last handshake of an entry, the wait before it closes that entry's
# connections: each survivor's own wait for the pair then returned long ago (a close during it
# fails that survivor's making: seen with no wait), and the close reaches a made communicator
SETTLE_S = 0.3
# a stand-in entry whose live ranks do not all come closes anyway after this long
GIVE_UP_S = 60.0
_BLOCK = 1 << 20  # pair ids: entry index * _BLOCK + rank (the number names the entry)


def _later(delay: float, fn: Callable, *args) -> None:
    """`fn(*args)` after `delay` s on a daemon thread (a process's exit never waits for it)."""
    t = threading.Timer(delay, fn, args=args)
    t.daemon = True
    t.start()


@dataclasses.dataclass
class _Made:
    expected: int
    on_closed: Callable[[], None]
    conns: list = dataclasses.field(default_factory=list)
    done: int = 0
    closed: bool = False


class StandIn:
    """A socket of this process answering gloo's connection handshake for dead ranks (the
    module docstring). One per process and address family, made on first use (`stand_in_for`);
    `entry` gives a dead rank's rendezvous entry for a clique whose live ranks' entries are
    known, starts the connections to the live ranks that wait for the dead one's, and closes
    them once every live rank has made its pair (`SETTLE_S` later), then calls `on_closed`."""

    def __init__(self, family: int, ip: str):
        self.family, self.ip = family, ip
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((ip, 0))
        self._sock.listen(256)
        self.port = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._made: list[_Made] = []
        threading.Thread(target=self._accept, daemon=True, name="elasjax-standin").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._take, args=(conn,), daemon=True,
                             name="elasjax-standin").start()

    def _take(self, conn: socket.socket) -> None:
        """A survivor connected and writes the number it was told (entry * _BLOCK + rank)."""
        got = b""
        try:
            conn.settimeout(GIVE_UP_S)
            while len(got) < _SEQ.size:
                part = conn.recv(_SEQ.size - len(got))
                if not part:
                    break
                got += part
        except OSError:
            pass
        if len(got) < _SEQ.size:
            conn.close()
            return
        # (where gloo numbers pairs by rank, every survivor writes its rank and every
        # handshake counts for entry 0, so that entry closes early and the others at
        # GIVE_UP_S: gloo numbers by rank only under GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER=1)
        idx = _SEQ.unpack(got)[0] // _BLOCK
        if not 0 <= idx < len(self._made):
            conn.close()
            return
        self._handshake(self._made[idx], conn)

    def _call(self, made: _Made, peer: Entry, seq: int) -> None:
        """A survivor waits for the dead rank to connect: connect, write its number."""
        try:
            conn = socket.create_connection((peer.ip, peer.port), timeout=GIVE_UP_S)
            conn.sendall(_SEQ.pack(seq))
        except OSError:
            return
        self._handshake(made, conn)

    def _handshake(self, made: _Made, conn: socket.socket) -> None:
        with self._lock:
            if made.closed:
                conn.close()
                return
            made.conns.append(conn)
            made.done += 1
            last = made.done == made.expected
        if last:
            _later(SETTLE_S, self._close, made)

    def _close(self, made: _Made) -> None:
        with self._lock:
            if made.closed:
                return
            made.closed = True
            conns, made.conns = made.conns, []
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        made.on_closed()

    def entry(self, dead_rank: int, size: int, live: dict[int, Entry],
              on_closed: Callable[[], None]) -> tuple[bytes, Callable[[], None]]:
        """Rank `dead_rank`'s entry in a communicator of `size` ranks whose live ranks have
        all published (`live`), and what starts the connections to the live ranks that wait
        for it (each pair's side settled by the addresses, as gloo settles it): called once the
        entry is written, so that a survivor whose write lost to another's calls no one."""
        with self._lock:
            idx = len(self._made)
            made = _Made(expected=len(live), on_closed=on_closed)
            self._made.append(made)
        me = _key(self.family, self.ip, self.port)
        # the live rank's own address for this pair carries the number it waits for
        waiting = [peer for r, peer in live.items()
                   if not _connects(_key(peer.family, peer.ip, peer.port),
                                    peer.seq_for(dead_rank), me, idx * _BLOCK + r)]

        def start() -> None:
            _later(GIVE_UP_S, self._close, made)
            for peer in waiting:
                threading.Thread(target=self._call, args=(made, peer, peer.seq_for(dead_rank)),
                                 daemon=True, name="elasjax-standin").start()

        addr = _sockaddr(self.family, self.ip, self.port) + _SEQ.pack(-1)
        ids = b"".join(_SEQ.pack(idx * _BLOCK + r) for r in range(size))
        return (struct.pack("=Q", len(HOSTNAME)) + HOSTNAME + struct.pack("=Q", len(addr))
                + addr + ids), start


_stand_in: StandIn | None = None
_made = threading.Lock()


def stand_in_for(peers: list[Entry]) -> StandIn | None:
    """This process's stand-in, made on first use on the family and an address of this host
    among `peers`' (gloo pairs connect within one family); None where none of them can be
    listened on here."""
    global _stand_in
    with _made:
        if _stand_in is not None and any(p.family == _stand_in.family for p in peers):
            return _stand_in
        for p in peers:
            try:
                _stand_in = StandIn(p.family, p.ip)
            except OSError:  # another host's address
                continue
            return _stand_in
    return None
