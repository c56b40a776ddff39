"""Role split: which ranks serve and which work, spread evenly over nodes.

`assign_servers` is a pure function (tested without MPI); `Cluster.create` gathers each
rank's node from ``Split_type(COMM_TYPE_SHARED)`` and builds the server and worker
communicators.  Only the entry point passes ``COMM_WORLD`` in.
"""
from dataclasses import dataclass

import numpy as np


def default_servers(n_ranks):
    """Half the ranks, at least 1."""
    return max(1, n_ranks // 2)


def check_servers(n_servers, n_ranks):
    """Raise ValueError with the remedy when S servers cannot run on N ranks."""
    if n_ranks < 2:
        raise ValueError("parameter-server mode needs at least 2 ranks (1 server + 1 worker); "
                         f"got {n_ranks} (run mpirun -n 4, or use --local)")
    if n_servers < 1:
        raise ValueError(f"--servers must be at least 1; got {n_servers}")
    if n_servers >= n_ranks:
        raise ValueError(f"--servers {n_servers} needs at least {n_servers + 1} ranks; got "
                         f"{n_ranks} (run mpirun -n {n_servers + 1} or lower --servers)")


def assign_servers(node_of_rank, n_servers):
    """Pick server ranks round-robin over nodes, the lowest free rank of each node first.

    node_of_rank: list of node ids (any hashable), one per world rank.
    Returns the sorted list of server ranks. With 2 nodes x 2 ranks and 2 servers this gives
    one server and one worker per node, the placement Paddle recommends.
    """
    nodes = {}
    for rank, node in enumerate(node_of_rank):
        nodes.setdefault(node, []).append(rank)
    queues = [list(r) for r in nodes.values()]   # in order of first rank
    chosen = []
    while len(chosen) < n_servers:
        for q in queues:
            if q and len(chosen) < n_servers:
                chosen.append(q.pop(0))
    return sorted(chosen)


@dataclass
class Cluster:
    """One rank's view of the job."""
    comm: object            # the world communicator (mpi4py Comm)
    rank: int               # world rank
    is_server: bool
    server_ranks: list      # world ranks of servers, index = server id (owner of a share of the ids)
    worker_ranks: list      # world ranks of workers, index = worker id
    role_comm: object       # communicator of this rank's role (servers or workers)
    hosts: list             # host name per world rank

    @property
    def index(self):
        """Index of this rank among its role (server id or worker id)."""
        ranks = self.server_ranks if self.is_server else self.worker_ranks
        return ranks.index(self.rank)

    @property
    def n_servers(self):
        return len(self.server_ranks)

    @property
    def n_workers(self):
        return len(self.worker_ranks)

    def role_map(self):
        """Lines `rank R host H role ...` for the log."""
        out = []
        for r, h in enumerate(self.hosts):
            if r in self.server_ranks:
                out.append(f"rank {r} host {h} server {self.server_ranks.index(r)} "
                           f"of {self.n_servers}")
            else:
                out.append(f"rank {r} host {h} worker {self.worker_ranks.index(r)}")
        return out

    @classmethod
    def create(cls, comm, n_servers):
        """Split `comm` into servers and workers (collective over `comm`)."""
        from mpi4py import MPI      # here: the role arithmetic above is used without MPI
        check_servers(n_servers, comm.size)
        node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED)
        leader = np.array([comm.rank], dtype=np.int64)
        node_comm.Bcast(leader, root=0)     # world rank of this node's first rank
        node_comm.Free()
        nodes = np.empty(comm.size, dtype=np.int64)
        comm.Allgather(leader, nodes)
        name = np.zeros(256, dtype=np.uint8)
        raw = MPI.Get_processor_name().encode()[:256]
        name[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        names = np.empty((comm.size, 256), dtype=np.uint8)
        comm.Allgather(name, names)
        hosts = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in names]
        servers = assign_servers(nodes.tolist(), n_servers)
        workers = [r for r in range(comm.size) if r not in servers]
        is_server = comm.rank in servers
        role_comm = comm.Split(0 if is_server else 1, comm.rank)
        return cls(comm, comm.rank, is_server, servers, workers, role_comm, hosts)
