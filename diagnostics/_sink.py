"""Loopback sink, run as a separate process (stdlib only, so it starts in milliseconds).

usage: python _sink.py ADDRESS IDLE_TIMEOUT_S   -> prints its port, then serves connections:
  'B' + bytes until EOF  -> replies with the byte count (8 bytes, network order)
  'P' + 64-byte pings    -> echoes them, busy-polling so that wake-up latency does not drown the link's
"""
import os
import socket
import struct
import sys


def main(address: str, idle_s: float) -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind((address, 0))
    srv.listen(4)
    srv.settimeout(idle_s)
    print(srv.getsockname()[1], flush=True)
    buf = bytearray(1 << 20)
    while True:
        try:
            conn, _ = srv.accept()
        except OSError:  # idle for too long: the parent is gone or done
            return
        with conn:
            conn.settimeout(idle_s)
            try:
                mode = conn.recv(1)
                if mode == b"B":
                    total = 0
                    while n := conn.recv_into(buf):
                        total += n
                    conn.sendall(struct.pack("!Q", total))
                elif mode == b"P":
                    _echo_spinning(conn)
            except OSError:
                continue


def _echo_spinning(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.setblocking(False)
    while True:
        try:
            data = conn.recv(4096)
        except BlockingIOError:
            os.sched_yield()  # stays runnable; lets the sender run if it shares our core
            continue
        if not data:
            return
        conn.setblocking(True)
        conn.sendall(data)
        conn.setblocking(False)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
