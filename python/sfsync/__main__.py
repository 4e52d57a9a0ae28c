"""``python3 -m sfsync``: the doctor (sfsync/doctor.py). One ``key: value``
line each: library path and version, ABI version, backends and why not, the
NCCL module, the launcher discovery (the library's sf_discover_launcher),
torch and whether the shim can serve it."""

import sys

from sfsync import doctor

sys.exit(doctor.main())
