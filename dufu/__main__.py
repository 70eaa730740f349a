"""`python -m dufu ...`: the same as the `dufu` command (dufu.cli.main)."""

import sys

from dufu.cli import main

sys.exit(main())
