"""`python -m rollgym.cli ...`, the same as the `rollgym` console script."""

import sys

from . import main

sys.exit(main())
