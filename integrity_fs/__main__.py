"""``python -m integrity_fs``: the ``integrity-fs`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
