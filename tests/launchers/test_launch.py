"""sfsync.launch (Python) gives what the library's sf_options_init gives, for
every launcher's variables: the same rank, world, local rank and meeting
point, the same contradictions, and the same no-meeting-point verdict (which
sf_create reports). Then ``python3 -m sfsync`` under mpirun prints what each
rank discovered. Run: PYTHONPATH=python SFSYNC_LIBRARY=... python3 test_launch.py [MPIRUN]"""

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


def check_nodelists():
    failures = 0
    for text, want in [("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
                       ("a[8-10],b,c[1,3]", ["a8", "a9", "a10", "b", "c1", "c3"]),
                       ("g3x[1-2]-r[01-02]", ["g3x1-r01", "g3x1-r02", "g3x2-r01", "g3x2-r02"]),
                       ("rack2node[098-101]", ["rack2node098", "rack2node099", "rack2node100",
                                               "rack2node101"])]:
        if launch.expand_nodelist(text) != want:
            print("FAIL expand_nodelist(%r) = %r" % (text, launch.expand_nodelist(text)))
            failures += 1
    for bad in ["", "node[01-04", "node01-04]", "a,,b", ",a", "a[]", "a[x-y]", "a[4-2]", "a[[1]]",
                "[1-2]", "a[1--2]", "a[1-2,]", "n[0-1000000]"]:
        try:
            launch.expand_nodelist(bad)
            print("FAIL expand_nodelist(%r) accepted" % bad)
            failures += 1
        except ValueError:
            pass
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
                     % (r, r), "library: rank=%d world=2 local_rank=%d rendezvous=mpi://" % (r, r)):
            if want not in text:
                print("FAIL python3 -m sfsync under mpirun: %r missing from\n%s" % (want, text))
                failures += 1
    print("python3 -m sfsync under mpirun -np 2:\n" + text)
    return failures + (out.returncode != 0)


if __name__ == "__main__":
    failed = check_agreement() + check_nodelists()
    if len(sys.argv) > 1:
        failed += check_module_under_mpirun(sys.argv[1])
    print("%d failures" % failed)
    sys.exit(1 if failed else 0)
