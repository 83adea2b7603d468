"""What runs inside a worker, from fork or exec to its exit.

Two entries, one per way a worker comes to life, each ending in
``os._exit`` with the worker's exit code:

- ``forked.forked_child``: right after fork() in the caller (start method
  "fork") or in the zygote ("zygote", and "forkserver", which it serves);
- ``spawned.spawn_main``: a fresh interpreter exec'd by the C launcher
  ("spawn").

Both run ``fn(rank, *args)`` and report through ``run``; ``stdio`` and
``stacks`` set up the streams and the stack dump; ``elastic_rank`` and
``script_rank`` are the fns of ``fastspawn.elastic``'s and ``fastspawn
run``'s ranks.  A spawned worker imports this package on every start: it
imports only ``_wire`` and ``_os`` below it, and little of the standard
library before it needs it.
"""
