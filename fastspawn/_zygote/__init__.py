"""The zygote: a clean interpreter, started once per caller, that forks
spawn-safe workers on request (start methods "zygote" and "forkserver").

The caller starts it once (a clean exec, so it inherits none of the caller's
threads, locks or CUDA state; it prepares like a spawn child: the caller's
sys.path and cwd, ``__main__`` imported as ``__mp_main__``, plus preloaded
modules) and sends it one message per launch, whatever the number of ranks:
the payload (fn and args, pickled once) travels as a memfd, the launch's
report channel and any fds the arguments carry as SCM_RIGHTS.  The zygote
unpickles once and forks every rank from that state.  Its first word on
the channel (TAKEN) comes before any rank can start: a launch whose channel
ends without it started nothing, and if the zygote was killed (or stopped),
the caller sends it to a new one.

Orphan safety, as a chain with no gaps:
- the zygote watches the caller *process* with a pidfd (and its control
  socket's EOF); PR_SET_PDEATHSIG(SIGTERM), armed before exec (on the guard,
  below, which passes it on), backs that up.  When the caller is gone it
  kills every worker and every descendant, then exits;
- each worker has PR_SET_PDEATHSIG(SIGKILL) against the single-threaded
  zygote, re-checked after prctl;
- the zygote is a child subreaper: a worker's orphaned children are
  reparented to it, and it kills them (those of a multiprocessing process,
  fastspawn._mp's, it keeps until they exit or it does: multiprocessing's
  outlive their parent);
- the process the caller starts forks the zygote proper and stays behind as
  its guard (a subreaper too): if the zygote is SIGKILLed, the guard adopts
  what the dying workers leave, daemons included, and kills it; if the guard
  is, the zygote's PR_SET_PDEATHSIG(SIGTERM) shuts it down in order;
- the workers of a launch share a process group of their own (its leader,
  an anchor process, exits at once: no rank leads it, so each may still
  call setsid()), and so do their children: the caller stops a launch with
  one killpg, and once the zygote is gone, the caller kills every live
  launch's group (and the zygote's own, whose id cannot be recycled while
  the guard is its unreaped child).

The control channel is an inherited socketpair: there is no name to connect
to.  A multiprocessing process (fastspawn._mp) gets a socketpair of its own
to the zygote, its link, through which its own processes come from the
zygote too: they outlive it, as multiprocessing's outlive their parent, and
die with the zygote.  Exit statuses go back on each launch's channel, sent without blocking
(the caller may not be reading) and queued until the caller drains it.

Modules: ``main`` (the process's entry, and the guard), ``server`` (the
main loop), ``forking`` (a launch's ranks started), ``launch`` (one launch's
state), ``signals`` (the zygote's handlers and the workers'), ``protocol``
(every message, both ends), ``client`` (the caller's handle on it),
``link`` (a multiprocessing process's own channel to it), ``ready`` (the
workers it keeps forked ahead) and ``wake`` (such a worker's side).
"""
