"""`python -m aioprefill.bench`: see `aioprefill.bench.main`."""

import sys

from aioprefill.bench.main import main

sys.exit(main())
