"""Print torch.cuda.memory_summary() of made-up allocator statistics (no GPU needed): the
table is PyTorch's own code's, the figures are chosen. Run with PyTorch installed:
``python record_memory_summary.py > memory_summary_2_13.txt``."""

import torch.cuda.memory as m

MiB = 1 << 20
SIZES = {"allocated_bytes": (6100, 9000, 123456, 117356),
         "active_bytes": (6100, 9000, 123456, 117356),
         "requested_bytes": (6090, 8990, 123000, 116910),
         "reserved_bytes": (9300, 9800, 12000, 2700),
         "inactive_split_bytes": (1500, 2100, 50000, 48500)}
COUNTS = {"allocation": (812, 900, 50000, 49188), "active": (812, 900, 50000, 49188),
          "segment": (40, 44, 60, 20), "inactive_split": (31, 35, 9000, 8969)}
stats = {}
for name, values in {**{k: tuple(v * MiB for v in vs) for k, vs in SIZES.items()},
                     **COUNTS}.items():
    for pool, share in (("all", None), ("large_pool", 0.9), ("small_pool", 0.1)):
        for key, x in zip(("current", "peak", "allocated", "freed"), values):
            stats[f"{name}.{pool}.{key}"] = x if share is None else int(x * share)
for key in ("current", "peak", "allocated", "freed"):
    stats[f"oversize_allocations.{key}"] = 0
    stats[f"oversize_segments.{key}"] = 0
stats.update(num_alloc_retries=3, num_ooms=1, num_sync_all_streams=0, num_device_alloc=60,
             num_device_free=20)
m.memory_stats = lambda device=None: stats
print(m.memory_summary(device=0, abbreviated=False))
