"""``python -m fastspawn run ...``: see ``fastspawn run --help``."""

from fastspawn._cli import console_main

if __name__ == "__main__":
    console_main()
