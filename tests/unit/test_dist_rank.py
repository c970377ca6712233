"""``dist.RankCache``: a process's rank read once, again only once a process group exists (a
real gloo group of one process, in a fresh interpreter: the group is the process's)."""
import subprocess
import sys


def test_rank_is_read_again_once_the_process_group_exists(tmp_path):
    script = f"""
import os
import torch.distributed as dist
from probekit.dist import RankCache
os.environ["RANK"] = "3"
cache = RankCache()
assert cache.get() == 3
os.environ["RANK"] = "5"          # the launcher's RANK is read once per process
assert cache.get() == 3
dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0,
                        world_size=1)
try:
    assert cache.get() == 0        # the group's rank, read again once it exists
    os.environ["RANK"] = "7"
    assert cache.get() == 0
finally:
    dist.destroy_process_group()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
