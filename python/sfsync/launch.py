"""Which launcher started this process, and where its ranks meet: the same
precedence as the library's (plugin/launch/launcher_env.h), in Python, so
that a trainer can ask before it makes a context (``python3 -m sfsync``
prints it). The library applies the same rules itself in sf_options_init;
``test_launch.py`` checks that both agree.

Rank variables, first group set wins (a group's rank or size variable set):

========  ==============================================================
sfsync    ``SF_RANK``, ``SF_WORLD_SIZE``, ``SF_LOCAL_RANK``
torchrun  ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``
openmpi   ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``
pmi       ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID`` (MPICH, Intel MPI)
slurm     ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``
========  ==============================================================

Meeting point: ``SF_RENDEZVOUS``; else ``MASTER_ADDR`` (``env://``); else,
for a world above one, ``mpi://`` under an MPI launcher whose libmpi loads;
else under Slurm ``tcp://FIRST_HOST:PORT`` (first host of
``SLURM_STEP_NODELIST`` or ``SLURM_JOB_NODELIST``; ``MASTER_PORT``, else
``20000 + (SLURM_JOB_ID % 1000) * 10 + SLURM_STEP_ID % 10``); else an error
naming the variables (``Launch.unmet``).
"""

import ctypes
import os
import re
from collections import namedtuple

_GROUPS = (
    ("sfsync", "sfsync", "SF_RANK", "SF_WORLD_SIZE", "SF_LOCAL_RANK"),
    ("torchrun", "torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("openmpi", "Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("pmi", "MPICH/Intel MPI (PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("slurm", "Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)
_MAX_RANKS = 1 << 30
_MAX_HOSTS = 1000000

#: What discover() found. ``error``: contradictory variables (sf_options_init
#: fails with it); ``unmet``: a world above one with no meeting point
#: (sf_create fails with it).
Launch = namedtuple("Launch", "launcher rank_vars rank world_size local_rank rendezvous meeting "
                              "error unmet")


def _get(env, name):
    v = env.get(name)
    return v if v else None


def _int(name, value, lo, hi):
    if re.fullmatch(r"[+-]?[0-9]+", value.strip()) is None or not lo <= int(value) <= hi:
        raise ValueError("environment variable %s='%s' is not an integer in [%d, %d]"
                         % (name, value, lo, hi))
    return int(value)


def slurm_port(job_id, step_id=0):
    """The store port of a Slurm step, in [20000, 29999]."""
    return 20000 + (int(job_id) % 1000) * 10 + int(step_id) % 10


def expand_nodelist(nodelist, limit=None):
    """Slurm's compressed host list as a list: ``"node[01-04,07],gpu3"`` ->
    node01..node04, node07, gpu3 (zero padding kept). ValueError naming the
    list when malformed."""
    def bad(why):
        return ValueError("node list '%s': %s" % (nodelist, why))
    if not nodelist:
        raise ValueError("node list is empty")
    items, depth, start = [], 0, 0
    for i, c in enumerate(nodelist + ","):
        depth += (c == "[") - (c == "]")
        if depth < 0 or depth > 1:
            raise bad("unbalanced or nested brackets")
        if c == "," and depth == 0:
            item = nodelist[start:i]
            if not item or item[0] == "[":
                raise bad("empty host name at offset %d" % start)
            items.append(item)
            start = i + 1
    if depth:
        raise bad("unbalanced '['")
    out = []
    for item in items:
        hosts = [""]
        for m in re.finditer(r"([^\[\]]*)(?:\[([^\[\]]*)\]|$)", item):
            text, inner = m.group(1), m.group(2)
            hosts = [h + text for h in hosts]
            if inner is None:  # the end of the item
                break
            values = []
            for part in inner.split(","):
                m = re.fullmatch(r"([0-9]{1,9})(?:-([0-9]{1,9}))?", part)
                if m is None:
                    raise bad("'[%s]' is not a list of numbers and ranges such as [01-04,07]"
                              % inner)
                lo, hi = m.group(1), m.group(2) or m.group(1)
                if int(hi) < int(lo):
                    raise bad("range %s is descending" % part)
                if int(hi) - int(lo) >= _MAX_HOSTS:
                    raise bad("expands past %d hosts" % _MAX_HOSTS)
                values += [str(x).zfill(len(lo)) for x in range(int(lo), int(hi) + 1)]
            if len(hosts) * len(values) > _MAX_HOSTS:
                raise bad("expands past %d hosts" % _MAX_HOSTS)
            hosts = [h + v for h in hosts for v in values]
        out += hosts
        if limit is not None and len(out) >= limit:
            return out[:limit]
        if len(out) > _MAX_HOSTS:
            raise bad("expands past %d hosts" % _MAX_HOSTS)
    return out


def mpi_probe(launcher):
    """"" when libmpi for ``launcher`` ("openmpi" or "pmi") loads, else why
    not (the library's candidates and SF_MPI_LIBRARY)."""
    setting = os.environ.get("SF_MPI_LIBRARY", "")
    if setting == "none":
        return "SF_MPI_LIBRARY=none"
    names = ([setting] if setting else
             ["libmpi.so.40", "libmpi.so"] if launcher == "openmpi" else
             ["libmpi.so.12", "libmpich.so.12", "libmpi.so"])
    errors = []
    for name in names:
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            return ""
        except OSError as e:
            errors.append(str(e))
    return "cannot load " + "; ".join(errors)


def _slurm_meeting(env):
    """(rendezvous, meeting, why-not, error)."""
    step_list = _get(env, "SLURM_STEP_NODELIST")
    nodelist = step_list or _get(env, "SLURM_JOB_NODELIST")
    list_var = "SLURM_STEP_NODELIST" if step_list else "SLURM_JOB_NODELIST"
    job = _get(env, "SLURM_JOB_ID") or _get(env, "SLURM_JOBID")
    step = _get(env, "SLURM_STEP_ID") or _get(env, "SLURM_STEPID")
    master_port = _get(env, "MASTER_PORT")
    if not nodelist or (not job and not master_port):
        missing = [m for m, ok in (("SLURM_JOB_NODELIST unset", nodelist),
                                   ("SLURM_JOB_ID unset", job)) if not ok]
        return None, None, "no Slurm meeting point (%s)" % ", ".join(missing), None
    try:
        host = expand_nodelist(nodelist, limit=1)[0]
        if master_port:
            port = _int("MASTER_PORT", master_port, 1, 65535)
            how = "MASTER_PORT=" + master_port
        else:
            job_id = _int("SLURM_JOB_ID", job, 0, 0x7fffffff)
            step_id = _int("SLURM_STEP_ID", step, 0, 0x7fffffff) if step else 0
            port = slurm_port(job_id, step_id)
            how = "port from SLURM_JOB_ID=" + job + (", SLURM_STEP_ID=" + step if step else "")
    except ValueError as e:
        return None, None, None, str(e)
    meeting = "Slurm: first host of %s='%s' (%s), %s" % (list_var, nodelist, host, how)
    return "tcp://%s:%d" % (host, port), meeting, None, None


def discover(env=None, probe=mpi_probe):
    """The Launch of ``env`` (default: os.environ). ``probe(launcher)``: ""
    when libmpi loads, else why not."""
    env = os.environ if env is None else env
    launcher, rank_vars, rank, world, local = "none", "", 0, 1, 0
    error = unmet = rendezvous = meeting = None
    for name, title, rank_var, size_var, local_var in _GROUPS:
        r, s, l = _get(env, rank_var), _get(env, size_var), _get(env, local_var)
        if not r and not s:
            continue
        launcher = name
        rank_vars = ("%s=%s" % (rank_var, r) if r else rank_var + " unset") + ", " + \
                    ("%s=%s" % (size_var, s) if s else size_var + " unset") + \
                    (", %s=%s" % (local_var, l) if l else "")
        try:
            if not r or not s:
                raise ValueError("%s's variables are incomplete: %s (set both %s and %s, or "
                                 "neither)" % (title, rank_vars, rank_var, size_var))
            rank = _int(rank_var, r, 0, _MAX_RANKS)
            world = _int(size_var, s, 1, _MAX_RANKS)
            local = _int(local_var, l, 0, _MAX_RANKS) if l else 0
            if rank >= world:
                raise ValueError("%s's variables contradict each other: %s=%s is not below %s=%s"
                                 % (title, rank_var, r, size_var, s))
            if l and local >= world:
                raise ValueError("%s's variables contradict each other: %s=%s is not below %s=%s"
                                 % (title, local_var, l, size_var, s))
        except ValueError as e:
            error = str(e)
        break
    result = lambda: Launch(launcher, rank_vars, rank, world, local, rendezvous, meeting, error,
                            unmet)
    if error:
        return result()
    if _get(env, "SF_RENDEZVOUS"):
        rendezvous = env["SF_RENDEZVOUS"]
        meeting = "SF_RENDEZVOUS=" + rendezvous
        return result()
    if _get(env, "MASTER_ADDR"):
        rendezvous = "env://"
        port = _get(env, "MASTER_PORT")
        meeting = "MASTER_ADDR=%s, %s" % (env["MASTER_ADDR"], "MASTER_PORT=" + port if port
                                          else "MASTER_PORT unset (29500)")
        return result()
    if world <= 1:
        return result()
    mpi_why = slurm_why = None
    if launcher in ("openmpi", "pmi"):
        mpi_why = probe(launcher)
        if not mpi_why:
            rendezvous, meeting = "mpi://", "MPI bootstrap: rank 0's address broadcast through MPI"
            return result()
    if launcher == "slurm" or (launcher in ("openmpi", "pmi") and _get(env, "SLURM_JOB_ID")):
        rendezvous, meeting, slurm_why, error = _slurm_meeting(env)
        if error or rendezvous:
            return result()
    unmet = ("%s say this process is rank %d of %d, but there is no way to meet the others: "
             "MASTER_ADDR and SF_RENDEZVOUS are unset" % (rank_vars, rank, world))
    if mpi_why:
        unmet += ", the MPI bootstrap is unavailable (%s)" % mpi_why
    if slurm_why:
        unmet += ", " + slurm_why
    unmet += (". Set MASTER_ADDR and MASTER_PORT (mpirun: -x MASTER_ADDR=host -x "
              "MASTER_PORT=port) or SF_RENDEZVOUS")
    return result()


def describe(launch=None):
    """One line for people: launcher, rank, world, local rank, meeting point."""
    launch = discover() if launch is None else launch
    line = "launcher=%s rank=%d world=%d local_rank=%d" % (
        launch.launcher, launch.rank, launch.world_size, launch.local_rank)
    if launch.error:
        return line + " ERROR: " + launch.error
    if launch.unmet:
        return line + " ERROR: " + launch.unmet
    return line + " rendezvous=%s (%s)" % (launch.rendezvous or "none",
                                           launch.meeting or "a world of one meets nobody")
