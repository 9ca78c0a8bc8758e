"""``python -m rollout`` is ``python -m rollout.server``."""

import sys

from rollout.server import main

sys.exit(main())
