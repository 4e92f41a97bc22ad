"""`python -m quantzoo ...`: the same as the `quantzoo` command."""
import sys

from quantzoo.cli import main

if __name__ == "__main__":
    sys.exit(main())
