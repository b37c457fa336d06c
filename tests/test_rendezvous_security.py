"""The rendezvous TCPStore listens only on the address the actors are given, and the process
group's keys live under a per-job secret prefix. One process, gloo, no Ray."""
from __future__ import annotations

import datetime
import socket
from pathlib import Path

import pytest
import torch.distributed as dist

from jabasray.actors.rendezvous import (Rendezvous, RendezvousServer, join_process_group,
                                        leave_process_group)


def _listeners(port: int) -> list[str]:
    """Local addresses of the LISTEN sockets on ``port`` (Linux /proc/net/tcp{,6})."""
    out = []
    for name, v6 in (("tcp", False), ("tcp6", True)):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for row in path.read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            addr, p = local.split(":")
            if int(p, 16) != port or state != "0A":      # 0A = LISTEN
                continue
            raw = bytes.fromhex(addr)
            if v6:
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                out.append(socket.inet_ntop(socket.AF_INET6, raw))
            else:
                out.append(socket.inet_ntop(socket.AF_INET, raw[::-1]))
    return out


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_store_listens_only_on_the_given_address():
    server = RendezvousServer(world_size=1, host="127.0.0.1", timeout_s=10)
    port = server.info.port
    assert _listeners(port) == ["127.0.0.1"]        # not 0.0.0.0 / :: (every interface)
    server.close()
    assert _listeners(port) == []                    # the store closed the socket


def test_keys_live_under_a_per_job_secret_prefix():
    a = RendezvousServer(world_size=1, host="127.0.0.1", generation=2, timeout_s=10)
    b = RendezvousServer(world_size=1, host="127.0.0.1", generation=2, timeout_s=10)
    try:
        info = Rendezvous.from_json(a.info.to_json())      # what travels to the actors
        assert len(info.secret) == 32 and int(info.secret, 16) >= 0    # 128 random bits
        assert info.secret != b.info.secret and info.secret not in repr(info)
        assert info.prefix == f"jabas/{info.secret}/gen2"
        join_process_group(info, rank=0)
        # the rank's store as join_process_group built it (c10d wraps it once more)
        dist.distributed_c10d._get_default_store().underlying_store.set("probe", "rank0")
        # another process that found the port: the guessable names hold nothing
        other = dist.TCPStore("127.0.0.1", info.port, world_size=None, is_master=False,
                              timeout=datetime.timedelta(seconds=5))
        assert not other.check(["jabas/gen2/probe"]) and not other.check(["probe"])
        assert other.check([f"{info.prefix}/probe"])                # only with the secret
        assert other.get(f"{info.prefix}/probe") == b"rank0"
    finally:
        leave_process_group()
        a.close()
        b.close()
