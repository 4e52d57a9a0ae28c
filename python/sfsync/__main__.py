"""``python3 -m sfsync``: the doctor (sfsync/doctor.py). One ``key: value``
line each: library path and version, ABI version, backends and why not, the
NCCL module, the launcher discovery (the library's sf_discover_launcher),
torch and whether the shim can serve it.

``python3 -m sfsync boot-path``: the folder to put first on PYTHONPATH, with
``SF_FOLLOW_HOST=1``, for the no-code path (sfsync/follow_boot.py)."""

import sys

if sys.argv[1:] == ["boot-path"]:
    from sfsync.follow_boot import boot_path
    print(boot_path())
    sys.exit(0)

from sfsync import doctor  # noqa: E402

sys.exit(doctor.main())
