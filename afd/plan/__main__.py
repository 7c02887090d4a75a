import sys

from afd.plan.cli import main

sys.exit(main())
