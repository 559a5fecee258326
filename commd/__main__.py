"""`python -m commd ...` is the `commd` command."""

import sys

from commd.cli.main import main

sys.exit(main())
