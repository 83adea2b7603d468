"""The command line: ``fastspawn run``, ``fastspawn stacks`` and the door to
``fastspawn bench`` (``main``); run's options (``options``), what it runs
where (``topology``), its log directory (``logdir``), the run and its
restarts (``restart``), and the ranks' stacks when it shows them
(``stacks``).
"""
