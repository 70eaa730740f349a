import sys

from dufu.cli import main

sys.exit(main())
