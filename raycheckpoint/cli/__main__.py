"""``python -m raycheckpoint.cli``: the ``raycheckpoint`` command."""

import sys

from raycheckpoint.cli import main

sys.exit(main())
