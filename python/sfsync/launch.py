"""Which launcher started this process, and where its ranks meet, asked of
the library: ``sf_discover_launcher`` (Since 0.4) runs the code that
``sf_options_init`` runs (plugin/launch/launcher_env.h), so a trainer can ask
before it makes a context and gets the library's one answer. ``python3 -m
sfsync`` and ``sfsync-run --discover`` print the same.

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
else under Slurm ``tcp://FIRST_HOST:PORT``; else an error naming the
variables (``Launch.unmet``). docs/launchers.md has the details.
"""

import ctypes
import os
from collections import namedtuple

import sfsync

__all__ = ["Launch", "discover", "describe"]

#: What discover() found. ``launcher``: "none", "sfsync", "torchrun",
#: "openmpi", "pmi" or "slurm"; ``rank_vars``: the group's variables as read;
#: ``rendezvous``: the meeting point (None when there is none); ``meeting``:
#: where it came from (None likewise); ``error``: contradictory variables
#: (sf_options_init fails with it; rank, world_size and local_rank are then
#: the defaults); ``unmet``: a world above one with no meeting point
#: (sf_create fails with it). ``error`` and ``unmet`` are None when clear.
Launch = namedtuple("Launch", "launcher rank_vars rank world_size local_rank rendezvous meeting "
                              "error unmet")


def _envp(env):
    """A NULL-terminated char** of "NAME=VALUE" for ``env`` (a mapping),
    and the buffers it points into."""
    entries = [("%s=%s" % (k, v)).encode("utf-8", "surrogateescape")
               for k, v in env.items() if "=" not in k]
    array = (ctypes.c_char_p * (len(entries) + 1))(*entries, None)
    return array, entries


def _text(raw):
    value = raw.decode("utf-8", "replace")
    return value or None


def discover(env=None):
    """The Launch of ``env`` (a mapping of variables; default: this
    process's environment, what sf_options_init reads), from the library's
    sf_discover_launcher."""
    info = sfsync.LaunchInfo()
    if env is None or env is os.environ:
        envp = None
    else:
        envp, _keep = _envp(env)
    sfsync.lib().sf_discover_launcher(ctypes.byref(info), ctypes.sizeof(info), envp)
    return Launch(info.launcher.decode(), info.rank_vars.decode("utf-8", "replace"), info.rank,
                  info.world_size, info.local_rank, _text(info.rendezvous), _text(info.meeting),
                  _text(info.error), _text(info.unmet))


def describe(launch=None):
    """One line for people: launcher, rank, world, local rank, meeting point
    (the line ``sfsync-run --discover`` prints after its ``sfsync-run: ``)."""
    launch = discover() if launch is None else launch
    line = "launcher=%s rank=%d world=%d local_rank=%d" % (
        launch.launcher, launch.rank, launch.world_size, launch.local_rank)
    if launch.error:
        return line + " ERROR: " + launch.error
    if launch.unmet:
        return line + " ERROR: " + launch.unmet
    return line + " rendezvous=%s (%s)" % (launch.rendezvous or "none",
                                           launch.meeting or "a world of one meets nobody")
