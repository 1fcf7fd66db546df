"""The training launch line: torchrun on one node, or one torchrun per node through srun (SLURM).

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


def torchrun(py: str, script: str, nproc: int, nodes: int = 1, virtual: bool = False,
             port: int = 29400) -> str:
    """`nproc` processes per node running `script`; `virtual` adds --virtual-local-rank (each rank sees
    its GPU as cuda:0)."""
    v = " --virtual-local-rank" if virtual else ""
    py, script = quote(str(py)), quote(str(script))  # a checkout path may hold spaces or quotes
    if nodes == 1:
        return f"{py} -m torch.distributed.run --standalone --nproc_per_node {nproc}{v} {script}"
    return (f"{py} -m torch.distributed.run --nnodes {nodes} --nproc_per_node {nproc}{v}"
            f" --rdzv-backend c10d --rdzv-endpoint {RDZV_HOST}:{port} --rdzv-id \"$SLURM_JOB_ID\" {script}")


def on_every_node(cmd: str, nodes: int) -> str:
    """`cmd` once on each of the allocation's `nodes` nodes; one failing task ends the others."""
    return f"srun --nodes {nodes} --ntasks {nodes} --ntasks-per-node 1 --kill-on-bad-exit=1 {cmd}"
