"""Rendezvous of the GPU actors into one ``torch.distributed`` process group.

The driver owns a ``torch.distributed.TCPStore`` (server side) bound to its node's IP and a free
port; every GPU actor connects to it as a client and calls ``init_process_group`` with that store
(NCCL on CUDA devices, gloo on CPU). Each placement of actors gets a fresh store (a new
*generation*), so actors of an old placement can never collide with the keys of a new one.

Security: the store's listening socket is bound by us to exactly the address the
actors are given (``host``; ``127.0.0.1`` stays on the loopback device) and handed to the store
(``master_listen_fd``), instead of the store's own bind to every interface. Every key lives under
a per-job random prefix of 128 bits (``Rendezvous.secret``, sent to the actors through Ray's own
channel and never logged), so a process that finds the port can neither read nor write the
group's keys: it cannot guess their names.
"""
from __future__ import annotations

import datetime
import logging
import secrets
import socket
from dataclasses import dataclass, field

from ..serialization import JsonMixin
from ..validation import check_choice, check_int

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")


def node_ip() -> str:
    """This process's node IP as Ray sees it (falls back to 127.0.0.1 without Ray)."""
    try:
        import ray
        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # pragma: no cover - ray missing or not initialised
        pass
    return "127.0.0.1"


def backend_for(device: str) -> str:
    """NCCL for CUDA devices, gloo for everything else."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


@dataclass(frozen=True)
class Rendezvous(JsonMixin):
    """Where and how the actors of one placement meet (plain data, sent to every actor)."""

    host: str                 # node IP of the driver, where the TCPStore server listens
    port: int                 # its port
    world_size: int           # number of GPU actors in this placement
    backend: str = "gloo"     # "gloo" (CPU) or "nccl" (CUDA)
    generation: int = 0       # placement counter; keys are prefixed with it
    timeout_s: float = 120.0  # collective / store timeout
    secret: str = field(default="", repr=False)   # per-job random key prefix (hex), never logged

    @property
    def prefix(self) -> str:
        """The store prefix of this generation's keys: unguessable without ``secret``."""
        return f"jabas/{self.secret}/gen{self.generation}"

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, min_value=1)
        check_int("port", self.port, min_value=1, max_value=65535)
        check_choice("backend", self.backend, BACKENDS)


class RendezvousServer:
    """Driver side: owns the TCPStore server for one generation. Keep it alive while the
    actors of that generation live; ``close()`` drops it."""

    def __init__(self, world_size: int, backend: str = "gloo", generation: int = 0,
                 timeout_s: float = 120.0, host: str | None = None,
                 ports: tuple[int, int] | None = None) -> None:
        import torch.distributed as dist

        self.host = host or node_ip()
        sock = listen_socket(self.host, ports)
        port = int(sock.getsockname()[1])
        try:   # the store takes over the listening socket (and closes it when dropped)
            self._store = dist.TCPStore(self.host, port, world_size=None, is_master=True,
                                        timeout=datetime.timedelta(seconds=timeout_s),
                                        wait_for_workers=False, master_listen_fd=sock.fileno(),
                                        use_libuv=True)
        except BaseException:
            sock.close()
            raise
        sock.detach()
        self.info = Rendezvous(self.host, port, world_size, backend, generation, timeout_s,
                               secret=secrets.token_hex(16))
        log.debug("rendezvous generation %d at %s:%d (world %d, %s)", generation, self.host, port,
                  world_size, backend)

    def close(self) -> None:
        self._store = None


def listen_socket(host: str, ports: tuple[int, int] | None = None) -> socket.socket:
    """A TCP socket listening on ``host`` only: on the first free port of ``ports`` (first, last;
    tried in order, so the port is deterministic on an idle node and within what the cluster's
    firewall opens), or on a free port the kernel chooses (None)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    candidates = [0] if ports is None else list(range(ports[0], ports[1] + 1))
    last: OSError | None = None
    for port in candidates:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((host, port))
            sock.listen(128)
            return sock
        except OSError as e:
            sock.close()
            last = e
    where = "" if ports is None else f" on any port of rendezvous_ports {list(ports)}"
    raise RuntimeError(f"could not listen on {host} for the rendezvous{where}: "
                       f"{last.strerror if last else 'no port'}")


def join_process_group(rdv: Rendezvous, rank: int, device: str | None = None):
    """Actor side: connect to the driver's store and initialise the default process group.

    ``device`` (a CUDA device): passed to NCCL as the group's ``device_id`` (it then binds the
    communicator to that GPU at once, also when the process sees several). Returns the default
    group (``torch.distributed.group.WORLD``). Any previous default group of
    this process is destroyed first (actors are normally fresh processes, so this only matters
    when the same process joins twice, e.g. in-process tests).
    """
    import torch
    import torch.distributed as dist

    check_int("rank", rank, min_value=0, max_value=rdv.world_size - 1)
    timeout = datetime.timedelta(seconds=rdv.timeout_s)
    if dist.is_initialized():
        dist.destroy_process_group()
    try:
        store = dist.TCPStore(rdv.host, rdv.port, world_size=None, is_master=False, timeout=timeout)
        store = dist.PrefixStore(rdv.prefix, store)
        extra = {"device_id": torch.device(device)} if device and rdv.backend == "nccl" else {}
        dist.init_process_group(rdv.backend, store=store, rank=rank, world_size=rdv.world_size,
                                timeout=timeout, **extra)
    except (RuntimeError, OSError) as e:   # DistStoreError/DistNetworkError are RuntimeErrors
        from ..errors import RendezvousFailed
        msg = " ".join(str(e).split())[:300]
        raise RendezvousFailed(f"rank {rank}: could not join the process group at "
                               f"{rdv.host}:{rdv.port} ({rdv.backend}) within {rdv.timeout_s:g}s: "
                               f"{type(e).__name__}: {msg}; check that the port is open between "
                               f"the nodes (DriverOptions.rendezvous_ports) and the network "
                               f"interface (actor_env NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME)") from None
    return dist.group.WORLD


def leave_process_group() -> None:
    """Destroy this process's default group if there is one."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _probe(host: str, port: int, timeout_s: float) -> str | None:
    """Runs on a GPU node: open a TCP connection to ``host:port``; None, or why it failed."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return None
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"


def check_reachable(nodes: dict[str, str], host: str, port: int, timeout_s: float = 10.0) -> None:
    """Every Ray node of ``nodes`` (Ray node id -> a name for the message) opens a TCP
    connection to ``host:port`` within ``timeout_s``: one Ray task per node, pinned to it (hard
    node affinity, no CPU), all at once. :class:`~jabasray.errors.PreflightFailed` (one line,
    naming the first node in ``nodes`` order that failed and the address) otherwise."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ..errors import PreflightFailed

    probe = ray.remote(num_cpus=0, max_retries=0)(_probe)
    refs = {nid: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False))
            .remote(host, port, timeout_s) for nid in nodes}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s + 60.0)
    for nid, ref in refs.items():
        if ref not in ready:
            why = "its probe task did not run within {:.0f}s".format(timeout_s + 60.0)
        else:
            try:
                why = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - the node died or refused the task
                why = f"its probe task failed: {type(e).__name__}"
        if why:
            raise PreflightFailed(f"pre-flight: GPU node {nodes[nid]} (Ray node {nid[:8]}) cannot "
                                  f"reach the driver's rendezvous at {host}:{port} ({why}); open "
                                  f"that port between the nodes (DriverOptions.rendezvous_ports) "
                                  f"or pick the interface (actor_env GLOO_SOCKET_IFNAME / "
                                  f"NCCL_SOCKET_IFNAME)")


def preflight(nodes: dict[str, str], host: str | None = None, ports: tuple[int, int] | None = None,
              timeout_s: float = 10.0) -> str:
    """The pre-flight connectivity check before any GPU actor starts: listen on the driver's
    node as the rendezvous store will (:func:`listen_socket`: the first free port of ``ports``)
    and let every GPU node connect to it (:func:`check_reachable`). Returns one line saying what
    was checked; raises :class:`~jabasray.errors.PreflightFailed` (one line) when no port of the
    range is free or a node cannot connect."""
    from ..errors import PreflightFailed

    host = host or node_ip()
    try:
        sock = listen_socket(host, ports)
    except RuntimeError as e:
        raise PreflightFailed(f"pre-flight: {e}") from None
    try:
        port = int(sock.getsockname()[1])
        check_reachable(nodes, host, port, timeout_s)
    finally:
        sock.close()
    return (f"pre-flight: {len(nodes)} GPU node(s) reached the driver's node at {host}:{port}"
            + (f" (rendezvous_ports {list(ports)})" if ports else ""))
