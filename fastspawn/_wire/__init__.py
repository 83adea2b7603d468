"""What crosses a process boundary: the report channel's messages, and fn,
args and results pickled (by value where ``__main__`` has no file).

Imported by every worker (spawned ones included), so it stays small: it
needs only ``_os``.
"""
