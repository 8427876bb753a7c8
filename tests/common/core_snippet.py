"""Use the shared core from your own code (the README's example, run as a test).

    mpiexec -n 4 python core_snippet.py
    torchrun --standalone --nproc-per-node 4 core_snippet.py
    python core_snippet.py
"""

import torch

from common import CommStats, ProcessGrid, autograd, collectives, init_distributed

ctx = init_distributed(device="cpu")  # mpiexec, torchrun, srun or a single process
x = 2 if ctx.world_size % 2 == 0 else 1
grid = ProcessGrid.plexus(x, ctx.world_size // x, 1)  # x * y * z ranks
grid.check(ctx.world_size)  # ValueError showing the arithmetic when the sizes do not multiply
# collective: every rank creates every group; gets the MPI transport under mpiexec
groups = ctx.create_groups(grid)
stats = CommStats()  # bytes and seconds per (axis, op), owned by the caller

# all-reduce over x, asynchronously: compute issued before wait() overlaps the communication
t = torch.full((4,), float(ctx.rank))
handle = collectives.all_reduce(t, groups["x"], stats=stats, async_op=True)
local = t * 2  # overlaps with the all-reduce
x_sum = handle.wait()

# an autograd pair: forward all-gather over y, backward reduce-scatter over y
w = torch.ones(2, requires_grad=True)
gathered = autograd.all_gather_reduce_scatter(w * (ctx.rank + 1), groups["y"], 0, stats)
gathered.sum().backward()

if ctx.is_main:
    print(f"grid {grid}: x-sum {x_sum[0].item():g}, gradient {w.grad.tolist()}")
    print(stats.table())
# no shutdown call: the core closes the process group and its watchdog at exit
