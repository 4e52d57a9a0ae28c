"""sfsync.launch (Python) asks the library (sf_discover_launcher): for every
launcher's variables it gives what sf_options_init and sf_create do (the same
rank, world, local rank and meeting point, the same contradictions, the same
no-meeting-point verdict), the same for an explicit mapping as for the
process's environment, and the very line ``sfsync-run --discover`` prints.
Then ``python3 -m sfsync`` under mpirun prints what each rank discovered.

    PYTHONPATH=python SFSYNC_LIBRARY=... python3 test_launch.py [--sfsync-run PATH] [MPIRUN]
"""

import os
import subprocess
import sys

import sfsync
from sfsync import launch

VARS = ["SF_RANK", "SF_WORLD_SIZE", "SF_LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_RANK",
        "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK",
        "PMI_SIZE", "MPI_LOCALRANKID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
        "SLURM_JOB_ID", "SLURM_JOBID", "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_JOB_NODELIST",
        "SLURM_STEP_NODELIST", "MASTER_ADDR", "MASTER_PORT", "SF_RENDEZVOUS", "SF_MPI_LIBRARY"]

SLURM = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "4242",
         "SLURM_STEP_ID": "3", "SLURM_JOB_NODELIST": "node[07-08]"}
OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
PMI = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0"}

CASES = [
    {},
    {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
    {"SF_RANK": "0", "SF_WORLD_SIZE": "3", "RANK": "2", "WORLD_SIZE": "5", "MASTER_ADDR": "h"},
    dict(OMPI), dict(OMPI, SF_MPI_LIBRARY="none"), dict(OMPI, **SLURM),
    dict(OMPI, SF_MPI_LIBRARY="none", **SLURM),
    dict(PMI, SF_MPI_LIBRARY="/nonexistent/libmpi.so.12"), dict(PMI, MASTER_ADDR="10.1.1.1"),
    dict(SLURM), dict(SLURM, SLURM_STEP_NODELIST="gpu[3-4]", MASTER_PORT="29999"),
    dict(SLURM, SLURM_STEP_ID=""), dict(SLURM, SLURM_JOB_NODELIST="x[1-"),
    dict(SLURM, SLURM_JOB_NODELIST=""), dict(SLURM, SF_RENDEZVOUS="file:///tmp/j"),
    {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
    {"OMPI_COMM_WORLD_RANK": "1"}, {"SLURM_NTASKS": "2"}, {"PMI_RANK": "x", "PMI_SIZE": "2"},
    {"SLURM_PROCID": "2", "SLURM_NTASKS": "2"}, {"RANK": "0", "WORLD_SIZE": "2"},
    {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "MASTER_ADDR": "h"},
    {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "0"},
    # Spaces in integers: once a known difference between the Python mirror
    # (int() strips them) and the library (strtol: leading blanks only); now
    # one answer, the library's.
    {"RANK": "1 ", "WORLD_SIZE": "2", "MASTER_ADDR": "h"},
    {"RANK": " 1", "WORLD_SIZE": "2", "MASTER_ADDR": "h"},
    {"SLURM_PROCID": "0", "SLURM_NTASKS": " 2 ", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"},
    {"SF_RENDEZVOUS": "file:///" + "d" * 300, "RANK": "1", "WORLD_SIZE": "2"},
]


def library_view():
    """(rank, world, local_rank, rendezvous, error) from sf_options_init and,
    for a world above one without rendezvous, sf_create's message."""
    try:
        o = sfsync.options().to_dict()
    except sfsync.SfError as e:
        return None, None, None, None, str(e)
    unmet = None
    if o["world_size"] > 1 and not o["rendezvous"]:
        try:
            sfsync.Context().close()
        except sfsync.SfError as e:
            unmet = str(e)
    return o["rank"], o["world_size"], o["local_rank"], o["rendezvous"], unmet


def check_agreement():
    failures = 0
    for case in CASES:
        for k in VARS:
            os.environ.pop(k, None)
        os.environ.update(case)
        py = launch.discover()
        rank, world, local, rdv, message = library_view()
        problems = []
        if py.error:
            if rank is not None or py.error not in (message or ""):
                problems.append("python error %r, library %r" % (py.error, message))
        elif py.unmet:
            if py.unmet not in (message or ""):
                problems.append("python unmet %r, library %r" % (py.unmet, message))
        if not py.error:
            want = (py.rank, py.world_size, py.local_rank, py.rendezvous or "")
            if (rank, world, local, rdv) != want:
                problems.append("python %r, library %r" % (want, (rank, world, local, rdv)))
        if py.world_size > 1 and not py.rendezvous and not py.unmet and not py.error:
            problems.append("a world above one without meeting point and no error")
        print("%s %s -> %s" % ("FAIL" if problems else "ok  ", case, launch.describe(py)))
        for p in problems:
            print("     " + p)
        failures += bool(problems)
    for k in VARS:
        os.environ.pop(k, None)
    return failures


def check_explicit_env():
    """discover(mapping) is discover() of that environment."""
    failures = 0
    for case in CASES:
        for k in VARS:
            os.environ.pop(k, None)
        os.environ.update(case)
        from_process = launch.discover()
        for k in VARS:
            os.environ.pop(k, None)
        given = launch.discover(dict(case, UNRELATED="x"))
        if given != from_process:
            print("FAIL discover(%r) = %r, with the process environment %r"
                  % (case, given, from_process))
            failures += 1
    return failures


def check_same_as_sfsync_run(sfsync_run):
    """``sfsync-run --discover`` prints "sfsync-run: " + describe(), for
    every case: one answer from one function."""
    failures = 0
    base = {k: v for k, v in os.environ.items() if k not in VARS}
    for case in CASES:
        env = dict(base, **case)
        out = subprocess.run([sfsync_run, "--discover"], env=env, capture_output=True, text=True,
                             timeout=60)
        want = "sfsync-run: " + launch.describe(launch.discover(case)) + "\n"
        code = 2 if launch.discover(case).error or launch.discover(case).unmet else 0
        if out.stdout != want or out.returncode != code:
            print("FAIL sfsync-run --discover with %r:\n  got  (%d) %r\n  want (%d) %r"
                  % (case, out.returncode, out.stdout, code, want))
            failures += 1
    print("sfsync-run --discover: %d cases, %d differ from sfsync.launch" % (len(CASES), failures))
    return failures


def check_module_under_mpirun(mpirun):
    env = {k: v for k, v in os.environ.items() if k not in VARS}
    out = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2",
                          sys.executable, "-m", "sfsync"], env=env, capture_output=True,
                         text=True, timeout=60)
    text = out.stdout + out.stderr
    failures = 0
    for r in (0, 1):
        for want in ("launch: launcher=openmpi rank=%d world=2 local_rank=%d rendezvous=mpi://"
                     % (r, r), "rank_vars: OMPI_COMM_WORLD_RANK=%d, OMPI_COMM_WORLD_SIZE=2, "
                     "OMPI_COMM_WORLD_LOCAL_RANK=%d\n" % (r, r)):
            if want not in text:
                print("FAIL python3 -m sfsync under mpirun: %r missing from\n%s" % (want, text))
                failures += 1
    print("python3 -m sfsync under mpirun -np 2:\n" + text)
    return failures + (out.returncode != 0)


if __name__ == "__main__":
    args = sys.argv[1:]
    sfsync_run = None
    if args[:1] == ["--sfsync-run"]:
        sfsync_run, args = args[1], args[2:]
    failed = check_agreement() + check_explicit_env()
    if sfsync_run:
        failed += check_same_as_sfsync_run(sfsync_run)
    if args:
        failed += check_module_under_mpirun(args[0])
    print("%d failures" % failed)
    sys.exit(1 if failed else 0)
