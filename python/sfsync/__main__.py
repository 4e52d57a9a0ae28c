"""``python3 -m sfsync``: which libsfsync this package loads, and what this
process's launcher says (sfsync.launch): launcher, rank, world, local rank
and meeting point, then the library's own view (sf_options_init)."""

import sfsync
from sfsync import launch

print("sfsync %s (ABI %d) from %s" % (sfsync.version(), sfsync.abi_version(),
                                      sfsync.library_path()))
print("launch: " + launch.describe())
try:
    o = sfsync.options().to_dict()
    print("library: rank=%d world=%d local_rank=%d rendezvous=%s" % (
        o["rank"], o["world_size"], o["local_rank"], o["rendezvous"] or "none"))
except sfsync.SfError as e:
    print("library: sf_options_init failed: %s" % e)
