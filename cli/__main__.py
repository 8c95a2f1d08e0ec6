"""`python -m cli`: the `tollgate` command."""

import sys

from cli.main import main

sys.exit(main())
