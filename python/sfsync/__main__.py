"""``python3 -m sfsync``: which libsfsync this package loads."""

import sfsync

print("sfsync %s (ABI %d) from %s" % (sfsync.version(), sfsync.abi_version(),
                                      sfsync.library_path()))
