"""``python -m gefen_titan ckpt|validate ...``: the ``gefen-titan`` command without the console script."""

import sys

from gefen_titan.cli import main

sys.exit(main())
