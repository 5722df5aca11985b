"""``python -m zero.compat [--force]``: print a fresh alias folder serving ``import deepspeed`` from zero, for
``PYTHONPATH=$(python -m zero.compat):$PYTHONPATH <launcher> ...`` (see :func:`zero.compat.alias.main`)."""

import sys

from zero.compat.alias import main

sys.exit(main())
