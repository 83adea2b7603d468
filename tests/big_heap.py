"""A module whose import leaves several MiB of small objects on the heap,
so that the zygote has stretches of memory to collapse into huge pages."""

OBJECTS = [(i, str(i)) for i in range(200_000)]
