"""`python -m quantzoo ...`: the same as the `quantzoo` command."""
import sys

from quantzoo.cli import main

sys.exit(main())
