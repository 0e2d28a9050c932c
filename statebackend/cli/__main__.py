"""``python -m statebackend.cli``: the ``statebackend`` command."""

import sys

from statebackend.cli import main

sys.exit(main())
