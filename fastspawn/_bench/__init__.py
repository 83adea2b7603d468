"""``fastspawn bench``: measure launch overhead on this machine.

Run as ``fastspawn bench [options]`` or ``python -m fastspawn bench``; the
methods, phases, options and exit statuses are in ``fastspawn bench --help``
(``options.DESCRIPTION``).

How a round is measured
-----------------------
Every rank of every Python method runs ``ranks.rank_main``.  It blocks SIGUSR1,
imports ``--import``'s modules (as a real ``fn``'s module would), writes an
"entered" record (its CLOCK_MONOTONIC time, which Linux shares between
processes) to a FIFO the bench reads, and sleeps in ``sigtimedwait`` until the
bench sends it SIGUSR1.  The bench waits for every rank's record, reads the
CPU time the launch took (``cputime``: the ranks', the helpers' and its own,
against a snapshot taken before the call), sums the ranks' USS, then
releases them: each writes an "exited" record and returns.
In a failure round only one rank is released; it writes a "failed" record and
raises, while the others sleep on until the launcher's teardown kills them.
A rank whose bench dies exits by itself (it polls a pidfd of the bench once a
second), so an interrupted bench leaves nothing behind even where it never
learnt a rank's pid.

The floors' ranks run ``rank_main`` too, without fastspawn: a small
helper interpreter (``python -I -S``, started untimed by
``floor.FloorMethod``) runs the source of ``ranks`` and forks them in a bare
``os.fork()`` loop when the bench asks over a socketpair (the program in
``_FLOOR_PROGRAM``); the helper reaps them and reports their pids and exit
statuses back.  The tables compare every Python method's "all running" to
the floor's: the same function's ranks, started by nothing but a fork.

``ranks`` is the ranks' ``fn`` module: spawn-like ranks import it (and
this package) to unpickle ``rank_main``.  Both therefore import only what a
rank needs, so a spawned rank does not pay for the bench's imports.

The modules: ``ranks`` (what a rank runs), ``common`` (the methods' names,
the errors), ``session`` (the report FIFO, the live launches), ``methods``
and ``floor`` (what each method starts), ``rounds`` (a round timed, the
plan, the warm-up, the sweep), ``cputime`` (a launch's CPU time),
``progress`` (the run's estimated length,
what it shows while it runs), ``summary`` (statistics, table, plot),
``host`` (the machine and its limits), ``options`` (the command line),
``main`` (a run, start to end).

JSON output (``--json FILE``)
-----------------------------
One object, described by the JSON Schema shipped in this package,
``fastspawn/_bench/bench.schema.json`` (draft 2020-12; ``main.load_schema``
reads it):

- ``schema``: ``"fastspawn-bench/3"``; ``started_at`` (UTC, ISO 8601);
  ``duration_s``.
- ``failed``: null when every round was measured; else the round that
  failed: ``method``, ``nprocs``, ``round`` (-1: the warm-up), ``kind``,
  ``message``; ``rounds`` and ``summary`` then hold the rounds finished
  before it.
- ``machine``: ``cpu`` (model name from /proc/cpuinfo), ``cores``,
  ``usable_cores`` (CPU affinity), ``kernel``, ``python``, ``fastspawn``
  (version), ``torch`` (version when the run imported it, else null),
  ``memory_bytes``, ``uncached_modules`` (how many of fastspawn's modules
  had no bytecode cache, so that every fresh interpreter compiled them;
  absent from documents written before it).
- ``config``: ``methods``, ``nprocs``, ``repeat``, ``full`` (--full),
  ``caps`` (method -> the largest nprocs it ran at, launch rounds only:
  the default run keeps torch-spawn so), ``imports``,
  ``payload_bytes``, ``pause_s`` (--pause; absent from documents written
  before it), ``binary`` (what binary methods start), ``argv``.
- ``rounds``: every raw sample, one object per round: ``method``, ``nprocs``,
  ``round`` (0-based), ``kind`` (``"launch"`` or ``"failure"``), and, in
  seconds unless named ``_bytes``, null where the phase does not apply:
  ``created_s``, ``running_s``, ``joined_s``, ``failure_s``, ``reaped_s``,
  ``uss_bytes``, ``helper_uss_bytes`` (the zygote or forkserver process
  itself), ``cpu_s`` with its parts ``rank_cpu_s``, ``helper_cpu_s`` and
  ``caller_cpu_s`` (time on a CPU from t0 until the bench had every rank's
  entry, see ``cputime``; absent from documents written before them),
  ``rank_entry_s`` and ``rank_exit_s`` (per rank, from t0).
- ``summary``: one object per method, nprocs and phase: ``phase`` (one of
  ``rounds.PHASES``), ``unit`` (``"s"`` or ``"bytes"``), ``rounds``, ``median``,
  ``p90``, ``min``, and ``ratio`` (median / the baseline's median) with
  ``baseline`` (``mp-spawn``, or ``binary-popen`` for binary methods), both
  null when the baseline was not measured; ``floor_ratio`` (median / the
  ``floor`` method's median for the same nprocs and phase), null for binary
  methods and where floor was not measured or has no such phase.
"""
