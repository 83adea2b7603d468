"""fastspawn as a multiprocessing context: ``multiprocessing``'s Process,
Pool, Queue, Manager, executors and torch's DataLoader started by fastspawn
(``context``: the contexts and their Process classes, registered with
multiprocessing by name; ``popen``: the handle multiprocessing drives;
``child``: the process's start in the worker; ``face``: the names of
``multiprocessing`` and ``torch.multiprocessing`` on ``fastspawn``).
"""
