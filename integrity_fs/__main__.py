"""``python -m integrity_fs``: the same as the ``integrity-fs`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
