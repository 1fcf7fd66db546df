"""The training launch line: the script itself for one process, torchrun on one node, or one torchrun
per node through srun (SLURM).

Several nodes: the train job's SLURM allocation holds the nodes; `srun` starts one task per node, each
task one torchrun with a process per GPU, and all of them meet at a c10d rendezvous on the first node
of the allocation (where the batch script, and so this line, runs). The shell of the job expands the
host and job id before srun starts the tasks.
"""

from __future__ import annotations

from shlex import quote

# The node this line runs on, the first of the allocation: torchrun hosts the rendezvous store on the node
# whose host name matches, every other agent connects to it.
RDZV_HOST = '"$(hostname)"'
RDZV_ID = '"$SLURM_JOB_ID"'


def torchrun_argv(
    py, script, nproc: int, nodes: int = 1, virtual: bool = False, port: int = 29400
) -> list[str]:
    """`nproc` processes per node running `script`; `virtual` adds --virtual-local-rank (each rank sees
    its GPU as cuda:0). On several nodes the rendezvous endpoint and id are shell words (RDZV_HOST,
    RDZV_ID) that the job's shell expands: such an argv runs only through `torchrun`'s line."""
    argv = [str(py), "-m", "torch.distributed.run"]
    argv += ["--standalone"] if nodes == 1 else ["--nnodes", str(nodes)]
    argv += ["--nproc_per_node", str(nproc)] + (["--virtual-local-rank"] if virtual else [])
    if nodes > 1:
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{RDZV_HOST}:{port}", "--rdzv-id", RDZV_ID]
    return argv + [str(script)]


def launch_argv(
    py, script, nproc: int, nodes: int = 1, virtual: bool = False, port: int = 29400
) -> list[str]:
    """`torchrun_argv`, except for one process on one node: then the script itself, which sets up no
    process group (distributed.setup_dist), and no agent process importing torch before it starts."""
    if nproc == 1 and nodes == 1:
        return [str(py), str(script)]
    return torchrun_argv(py, script, nproc, nodes, virtual, port)


def torchrun(
    py: str, script: str, nproc: int, nodes: int = 1, virtual: bool = False, port: int = 29400
) -> str:
    """`launch_argv` as a shell line: every word quoted (a checkout path may hold spaces or quotes)
    except the rendezvous words the shell must expand."""
    expand = {f"{RDZV_HOST}:{port}", RDZV_ID}
    argv = launch_argv(py, script, nproc, nodes, virtual, port)
    return " ".join(a if a in expand else quote(a) for a in argv)


def on_every_node(cmd: str, nodes: int) -> str:
    """`cmd` once on each of the allocation's `nodes` nodes; one failing task ends the others."""
    return f"srun --nodes {nodes} --ntasks {nodes} --ntasks-per-node 1 --kill-on-bad-exit=1 {cmd}"
