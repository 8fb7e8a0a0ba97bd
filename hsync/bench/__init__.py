"""Benchmarks hsync.WeightedDDP against torch DDP and against no synchronisation, side by side.

    python -m hsync.bench --device cpu --world-size 2 --json results.json --plot results.png
    python -m hsync.bench --device cuda --world-size 1 ...      # one GPU per rank, NCCL

Every workload times interleaved rounds of its variants (hsync weighted, hsync plain, torch DDP, no
sync) in the same processes, on the same model, data and seed, so machine noise falls on all of them
alike. Then it measures each variant's peak memory on its own. It spawns the ranks itself, or runs
under torchrun when RANK is set.
"""
