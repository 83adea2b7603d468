"""``python -m fastspawn run ...``: see ``fastspawn run --help``."""

from fastspawn._cli.main import console_main

if __name__ == "__main__":
    console_main()
