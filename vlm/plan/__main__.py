"""`python -m vlm.plan ARGS` is `vlm plan ARGS` (vlm.plan.cli)."""

import sys

from vlm.plan.cli import main

sys.exit(main())
