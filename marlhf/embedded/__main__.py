"""``python -m marlhf.embedded``: build (or find) the embedded default and print where it is."""

import sys

from marlhf.embedded import main

sys.exit(main())
