"""`python -m afd_cli ...` is the `afd` command (how `afd serve` starts its children)."""

import sys

from afd_cli.main import main

sys.exit(main())
