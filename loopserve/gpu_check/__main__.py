"""`python -m loopserve.gpu_check [--dry-run]`: see `loopserve.gpu_check.check`."""

import sys

from loopserve.gpu_check.check import main

sys.exit(main())
