"""``python -m marlhf`` is the ``marlhf`` command."""

import sys

from marlhf.cli.main import main

sys.exit(main())
